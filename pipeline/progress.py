"""The analysis as it is being written, for whoever follows it (the pages): the labels once
decided, then each field of the narrative once its text is complete. Shaped like `Analysis`,
unvalidated, superseded by the analysis itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pydantic_core

# Sees the analysis as written so far (`Analyzer.analyze`).
Progress = Callable[[dict[str, Any]], None]


class PartialNarrative:
    """Follows a narrative as it is generated: each time one more of its strings is complete (the
    viewpoint, an item, the rationale, a field), `progress` sees the labels decided and what is
    written so far, shaped like an `Analysis`."""

    def __init__(self, decided: dict[str, Any], progress: Progress) -> None:
        self.decided = decided
        self.progress = progress
        self.text = ""
        self.shown: Any = {}

    def feed(self, piece: str) -> None:
        self.text += piece
        if '"' not in piece:  # a string can only be complete where a quote closes it
            return
        try:
            written = pydantic_core.from_json(self.text, allow_partial=True)  # complete strings only
        except ValueError:
            return
        if not isinstance(written, dict) or written == self.shown:
            return
        self.shown = written
        sentiment = dict(self.decided["sentiment"])
        if isinstance(rationale := written.get("rationale"), str):
            sentiment["rationale"] = rationale
        view = {
            key: written[key] for key in ("core_viewpoint", "key_information", "fields") if key in written
        }
        self.progress({**self.decided, **view, "sentiment": sentiment})
