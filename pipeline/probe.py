"""A polarity probe: a linear reading of the model's own hidden state.

The polarity question's prompt is read by the model; the hidden state of its last token after
`depth` decoder layers (`AnalysisEngine.hidden`) goes through a logistic regression trained per
language on labelled documents that are never evaluated (`python -m bench.probe`). Its output is
the log-odds of positive against negative. A probe belongs to one model's weights: a bundled model
carries its own (`pipeline.bundled_models`), and it is refused for a model of another hidden size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ProbeError(ValueError):
    """A probe file that cannot serve: unreadable, malformed, or for another model."""


@dataclass(frozen=True)
class PolarityProbe:
    model: str  # the model it was trained on (bundled name or folder)
    depth: int  # decoder layers applied to the state it reads
    hidden_size: int
    # Per language: weights over the raw hidden state (the training standardisation folded in)
    # and the bias; log-odds of positive = weights . hidden + bias.
    weights: Mapping[str, tuple[float, ...]]
    bias: Mapping[str, float]
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def covers(self, language: str) -> bool:
        return language in self.weights

    def logit(self, language: str, hidden: Sequence[float]) -> float:
        """The log-odds of positive for a document in `language` whose state is `hidden`."""
        weights = self.weights[language]
        if len(hidden) != len(weights):
            raise ProbeError(f"a state of {len(hidden)} values for a probe of {len(weights)}")
        return math.fsum(w * h for w, h in zip(weights, hidden, strict=True)) + self.bias[language]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "languages": {
                lang: {"bias": self.bias[lang], "weights": list(self.weights[lang])} for lang in self.weights
            },
            "provenance": dict(self.provenance),
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> PolarityProbe:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            size = int(raw["hidden_size"])
            languages = raw["languages"]
            weights = {lang: tuple(float(w) for w in v["weights"]) for lang, v in languages.items()}
            bias = {lang: float(v["bias"]) for lang, v in languages.items()}
            probe = cls(str(raw["model"]), int(raw["depth"]), size, weights, bias, raw.get("provenance", {}))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProbeError(f"{path}: not a polarity probe ({exc})") from exc
        if probe.depth < 1 or any(len(w) != size for w in weights.values()):
            raise ProbeError(f"{path}: depth {probe.depth}, weights not of the hidden size {size}")
        return probe

    def check(self, hidden_size: int) -> None:
        """Refuses a model whose state is not this probe's width (the engine refuses a depth
        beyond its layers)."""
        if hidden_size != self.hidden_size:
            raise ProbeError(
                f"the polarity probe for {self.model} reads a state of {self.hidden_size} values; "
                f"this model's has {hidden_size}"
            )


# Sentence ends: CJK or Latin end punctuation (runs of it) or a line break.
_END = re.compile(r"[。！？!?；;]+|\.(?=\s|$)|\n+")


def parts(text: str, count: int) -> list[str]:
    """The text cut into at most `count` contiguous parts of about equal length, only at sentence
    ends (a single sentence stays whole); what joins them is left out, nothing else is."""
    cuts = [m.end() for m in _END.finditer(text) if 0 < m.end() < len(text)]
    if count <= 1 or not cuts:
        return [text.strip()] if text.strip() else []
    out, start = [], 0
    for k in range(1, count):
        target = len(text) * k / count
        cut = min((c for c in cuts if c > start), key=lambda c: abs(c - target), default=None)
        if cut is None or cut >= len(text):
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return [p.strip() for p in out if p.strip()]


def mean_log_odds(readings: Sequence[tuple[float, int]], bound: float = 10.0) -> float:
    """The length-weighted mean of (log-odds, length) readings, each clipped to ±`bound` first, so
    that one part read with extreme certainty cannot outvote the rest."""
    total = sum(length for _, length in readings)
    return sum(max(-bound, min(bound, odds)) * length for odds, length in readings) / total


def guarded(whole: float, readings: Sequence[float], below: float) -> float:
    """A complaint's reading checked against its parts' `readings`: where the whole reads positive
    and a part reads clearly negative (log-odds under `below`), that part's reading (the lowest);
    else the whole's. Text appended to steer a complaint positive carries the whole only while
    nothing else is read apart from it."""
    low = min(readings, default=whole)
    return low if whole > 0 and low < below else whole
