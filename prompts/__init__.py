"""Instruction templates per document kind × language, and the reader of the model's answer."""

from prompts.parse import AnalysisParseError, parse_analysis
from prompts.render import Message, Prompt, detect_language, fence, render, render_repair

__all__ = [
    "AnalysisParseError",
    "Message",
    "Prompt",
    "detect_language",
    "fence",
    "parse_analysis",
    "render",
    "render_repair",
]
