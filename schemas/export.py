"""Exports the JSON Schema of each wire model next to it, for consumers outside Python.

`python -m schemas.export` rewrites `schemas/json/`; a test fails when the files are stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from schemas.events import Analysis, AnalysisEvent, AnalysisProgress, DeadLetter, DocumentEvent

EXPORTED: dict[str, type[BaseModel]] = {
    "document_event": DocumentEvent,
    "analysis_event": AnalysisEvent,
    "analysis": Analysis,
    "dead_letter": DeadLetter,
    "analysis_progress": AnalysisProgress,
}

JSON_DIR = Path(__file__).with_name("json")


def render(model: type[BaseModel]) -> str:
    return json.dumps(model.model_json_schema(), indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def export(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in EXPORTED.items():
        path = directory / f"{name}.schema.json"
        path.write_text(render(model), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in export():
        sys.stdout.write(f"wrote {path}\n")
