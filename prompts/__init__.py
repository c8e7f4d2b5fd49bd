"""Instruction templates per document kind × language, and the reader of the model's answer."""

from prompts.injection import Screened, screen
from prompts.parse import AnalysisParseError, parse_analysis, parse_narrative
from prompts.render import Message, Prompt, Question, detect_language, fence, questions, render, render_repair

__all__ = [
    "AnalysisParseError",
    "Message",
    "Prompt",
    "Question",
    "Screened",
    "detect_language",
    "fence",
    "parse_analysis",
    "parse_narrative",
    "questions",
    "render",
    "render_repair",
    "screen",
]
