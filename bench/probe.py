"""Fits the polarity probe of a model (`pipeline.probe`) and reports how well it reads polarity.

For labelled documents that are never evaluated (`bench.real_data.training`: English review
sentences outside the quality benchmark's sample, Chinese news posts of the `train` split), the
polarity question's prompt (the analyser's own, on the screened text) is read by the engine and the
last token's hidden state taken at several depths (`Engine.hidden`). Per language, an L2-regularised
logistic regression on the standardised states; the depth (one for every language: one request per
document in the service) and each language's regularisation are chosen by 5-fold cross-validation
on these documents alone. Writes the probe (standardisation folded into the weights) and a report.

    python -m bench.probe                          # the default model -> pipeline/probes/<model>.json
    python -m bench.probe --per-language 200 --out /tmp/probe.json
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common, real_data
from pipeline.backends import EmbeddedBackend
from pipeline.probe import PolarityProbe
from prompts import questions, screen
from schemas import BUILT_IN_KINDS, DocumentKind, Language

# Depths as fractions of the model's decoder layers: 12, 15, 18 and 21 of the 0.5B model's 24.
DEPTH_FRACTIONS = (0.5, 0.625, 0.75, 0.875)
STRENGTHS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
FOLDS = 5


def fit(states: torch.Tensor, positive: torch.Tensor, strength: float) -> tuple[torch.Tensor, float]:
    """Weights over raw states and a bias: logistic regression on standardised states with an L2
    penalty of `strength` / 2 |w|^2 (LBFGS, float64, deterministic), the standardisation folded in."""
    x = states.double()
    mean, scale = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / scale
    y = positive.double()
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, reduction="sum")
        value = value + strength * (w @ w) / 2
        value.backward()  # type: ignore[no-untyped-call]
        return value

    opt.step(loss)  # type: ignore[no-untyped-call]
    weights = (w / scale).detach()
    return weights, float(b.detach()) - float((weights * mean).sum())


def cross_validated(states: torch.Tensor, positive: torch.Tensor, strength: float, seed: int = 0) -> float:
    """Accuracy over `FOLDS` folds, each fitted on the others."""
    order = list(range(len(positive)))
    random.Random(seed).shuffle(order)
    right = 0
    for fold in range(FOLDS):
        held = torch.tensor(order[fold::FOLDS])
        kept = torch.tensor([i for i in order if i not in set(held.tolist())])
        weights, bias = fit(states[kept], positive[kept], strength)
        right += int((((states[held].double() @ weights + bias) > 0) == positive[held].bool()).sum())
    return right / len(positive)


def depths_for(layers: int) -> tuple[int, ...]:
    """The depths read in a model of `layers` decoder layers."""
    return tuple(sorted({min(layers, max(1, round(f * layers))) for f in DEPTH_FRACTIONS}))


async def states_of(
    backend: EmbeddedBackend, docs: list[real_data.Labelled], depths: tuple[int, ...]
) -> torch.Tensor:
    """(N, len(depths), H): each document's polarity-question state at every depth."""

    async def one(doc: real_data.Labelled) -> torch.Tensor:
        language = Language(doc.language)
        asked = questions(BUILT_IN_KINDS[DocumentKind.FILING], language, screen(doc.text, language).labelled)
        messages = next(q for q in asked if q.name == "polarity").prompt.messages
        rows = []
        for depth in depths:  # after the first, the prompt's blocks come from the prefix cache
            rows.append(torch.tensor(await backend.hidden(messages, depth)))
        return torch.stack(rows)

    out: list[torch.Tensor] = []
    started = time.perf_counter()
    for i in range(0, len(docs), 16):
        out += await asyncio.gather(*(one(d) for d in docs[i : i + 16]))
        print(f"  {len(out)}/{len(docs)} documents read, {time.perf_counter() - started:.0f} s", flush=True)
    return torch.stack(out)


async def run(args: Any) -> tuple[PolarityProbe, dict[str, Any]]:
    engine = await common.analysis_engine(args.model)
    docs = real_data.training(args.per_language)
    depths = depths_for(engine.runner.num_layers)
    async with engine:
        started = time.perf_counter()
        states = await states_of(EmbeddedBackend(engine), docs, depths)
        seconds = time.perf_counter() - started
    grid: dict[str, dict[str, dict[str, float]]] = {}
    languages = sorted({d.language for d in docs})
    for lang in languages:
        rows = [i for i, d in enumerate(docs) if d.language == lang]
        positive = torch.tensor([docs[i].polarity == "positive" for i in rows], dtype=torch.float64)
        grid[lang] = {
            str(depth): {str(s): cross_validated(states[rows, k], positive, s) for s in STRENGTHS}
            for k, depth in enumerate(depths)
        }
    # One depth for every language (the mean of each language's best), then each language's strength.
    k = max(
        range(len(depths)), key=lambda k: sum(max(grid[lang][str(depths[k])].values()) for lang in languages)
    )
    depth = depths[k]
    weights, bias, chosen = {}, {}, {}
    for lang in languages:
        rows = [i for i, d in enumerate(docs) if d.language == lang]
        positive = torch.tensor([docs[i].polarity == "positive" for i in rows], dtype=torch.float64)
        accuracy = grid[lang][str(depth)]
        strength = max(STRENGTHS, key=lambda s: (accuracy[str(s)], s))  # ties: the stronger penalty
        w, b = fit(states[rows, k], positive, strength)
        weights[lang], bias[lang] = tuple(float(v) for v in w.tolist()), b
        chosen[lang] = {"strength": strength, "cross_validated_accuracy": accuracy[str(strength)],
                        "documents": len(rows)}  # fmt: skip
    provenance = {
        "program": "python -m bench.probe",
        "model_id": engine.model_id,
        "dtype": str(engine.loaded.dtype),
        "data": f"bench.real_data.training({args.per_language}): "
        + ", ".join(f"{n} {s}" for s, n in sorted(Counter(d.source for d in docs).items())),
        "chosen": chosen,
    }  # fmt: skip
    probe = PolarityProbe(args.name, depth, int(states.shape[-1]), weights, bias, provenance)
    report = {"model": engine.model_id, "depths": depths, "strengths": STRENGTHS, "folds": FOLDS,
              "grid": grid, "depth": depth, "chosen": chosen, "seconds_reading": round(seconds, 1),
              "documents": len(docs)}  # fmt: skip
    return probe, report


def show(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"polarity probe, {report['model']}: {FOLDS}-fold accuracy on training documents")
    table.add_column("language")
    table.add_column("depth", justify="right")
    for s in report["strengths"]:
        table.add_column(f"L2 {s}", justify="right")
    for lang, depths in report["grid"].items():
        for depth, row in depths.items():
            table.add_row(lang, depth, *(f"{row[str(s)]:.3f}" for s in report["strengths"]))
    console.print(table)
    console.print(f"chosen: depth {report['depth']}, {json.dumps(report['chosen'])}")


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--name", default=None, help="the model's name in the probe (default: MODEL)")
    parser.add_argument("--per-language", type=int, default=480)
    parser.add_argument("--out", type=Path, default=None, help="default: pipeline/probes/<name>.json")
    parser.add_argument("--report", type=Path, default=Path("bench/results/probe.json"))
    args = parser.parse_args()
    if args.name is None:
        from pipeline.settings import load_settings

        args.name = str(args.model) if args.model is not None else load_settings().model
    probe, report = asyncio.run(run(args))
    out = args.out or Path("pipeline/probes") / f"{args.name}.json"
    probe.write(out)
    args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    show(report, Console(width=140))
    print(f"wrote {out} and {args.report}")


if __name__ == "__main__":
    main()
