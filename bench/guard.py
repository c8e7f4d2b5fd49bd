"""How a complaint's positive reading is checked in parts (`LabelPolicy.guard_parts`, `guard_below`):
the numbers the choice was made on, from development data only.

    python -m bench.guard --out bench/results/guard-dev-cpu-0.5b-fp32.json
    python -m bench.guard --table bench/results/guard-dev-cpu-0.5b-fp32.json   # no model

The probe's reading of every injected case of the development injection sets (`heldout2` to
`heldout7`, screened as the service screens them) and of the real development split
(`bench.real_data.development`, never the evaluated sample), read whole; where the whole reads
positive, also read in 2 and 3 contiguous parts. The table: for each number of parts and each bound,
how many steered complaints read positive the check turns back to negative, against how many real
positive documents read as complaints it turns negative (and negative ones it rights).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from opentelemetry import trace
from rich.console import Console
from rich.table import Table

from bench import common, real_data
from bench.injection import PHRASINGS, appended, read_lines
from bench.quality import TEAM, bounded, team_rows
from pipeline.analyzer import Analyzer
from pipeline.backends import EmbeddedBackend
from prompts import screen
from schemas import DocumentKind, Language

SETS = ("heldout2", "heldout3", "heldout4", "heldout5", "heldout6", "heldout7")
PARTS = (2, 3)
BOUNDS = (0.0, -2.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0)


async def run(args: Any) -> dict[str, Any]:
    engine = await common.analysis_engine(args.model)
    base = common.label_policy(args.model)
    if base.probe is None:
        raise SystemExit("the model has no polarity probe: nothing to check in parts")
    policies = {n: dataclasses.replace(base, guard_parts=n, guard_below=0.0) for n in (1, *PARTS)}
    analyzers = {
        n: Analyzer(EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=512, attempts=2, policy=p)
        for n, p in policies.items()
    }
    bases = [b for b in team_rows(TEAM) if b["polarity"] == "negative"]
    cases = [(name, c) for name in SETS for c in appended(bases, read_lines(PHRASINGS[name]), 20)]
    dev = real_data.development(args.per_language)

    async def readings(language: str, text: str) -> dict[str, float]:
        lang = Language(language)
        body = screen(text, lang).labelled
        whole = await analyzers[1].reading(DocumentKind.FILING, lang, body)
        out = {"whole": whole}
        if whole > 0:  # the check reads parts only here; with bound 0: the lowest part's if negative
            for n in PARTS:
                out[str(n)] = await analyzers[n].checked(DocumentKind.COMPLAINT, lang, body, whole)
        return out

    async with engine:
        await analyzers[1].prepare()
        injected = await bounded(
            [lambda c=c: readings(c["base"]["language"], c["text"]) for _, c in cases], 32
        )
        documents = await bounded([lambda d=d: readings(d.language, d.text) for d in dev], 32)
    return {
        "model": engine.model_id,
        "injected": [
            {"set": name, "base": c["base"]["id"], "phrasing": c["phrasing"]["id"], **r}
            for (name, c), r in zip(cases, injected, strict=True)
        ],
        "development": [
            {"language": d.language, "label": d.polarity, "source": d.source, **r}
            for d, r in zip(dev, documents, strict=True)
        ],
    }


def turned(row: dict[str, Any], parts: int, bound: float) -> bool:
    """Whether a row's positive whole is overruled by a part (of `parts`) under `bound`."""
    return row["whole"] > 0 and row.get(str(parts), row["whole"]) < bound


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (parts, bound): steered complaints read positive and turned back; development positives
    turned negative and negatives righted (a part under the bound overrules a positive whole)."""
    steered = [r for r in results["injected"] if r["whole"] > 0]
    dev = results["development"]
    return [
        {"parts": n, "bound": bound, "steered_positive": len(steered),
         "steered_turned": sum(turned(r, n, bound) for r in steered),
         "dev_positive_turned": sum(turned(r, n, bound) for r in dev if r["label"] == "positive"),
         "dev_negative_righted": sum(turned(r, n, bound) for r in dev if r["label"] == "negative")}
        for n in PARTS
        for bound in BOUNDS
    ]  # fmt: skip


def show(rows: list[dict[str, Any]], console: Console) -> None:
    grid = Table("parts", "bound (log-odds)", "steered read positive", "turned back", "dev positives turned",
                 "dev negatives righted", title="A complaint's positive reading checked in parts")  # fmt: skip
    for r in rows:
        grid.add_row(str(r["parts"]), f"{r['bound']:.0f}", str(r["steered_positive"]), str(r["steered_turned"]),
                     str(r["dev_positive_turned"]), str(r["dev_negative_righted"]))  # fmt: skip
    console.print(grid)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--per-language", type=int, default=150, help="development documents per language")
    parser.add_argument("--out", type=Path, default=Path("bench/results/guard-dev.json"))
    parser.add_argument("--table", type=Path, default=None, help="a stored result: its table (no model)")
    args = parser.parse_args()
    if args.table is not None:
        results = json.loads(args.table.read_text(encoding="utf-8"))
    else:
        results = asyncio.run(run(args))
        results["table"] = table(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    show(table(results), Console(width=140))


if __name__ == "__main__":
    main()
