"""Two `bench.quality` runs on the same labelled documents, compared document by document.

Accuracy alone says how far apart two runs are; it does not say whether the gap is larger than a
run's own noise. Paired on each document: how many were right in one run and wrong in the other
(each way), McNemar's exact two-sided p over those discordant documents, and how often the runs
agree on each label (polarity, doubt, expectation); beside them each run's accuracy read as
complaints, as `bench.quality` reported it (its rows keep the reading, not the decision).

    python -m bench.quality_pair bench/results/quality-off.json bench/results/quality-int4.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Paired:
    n: int
    accuracy_a: float
    accuracy_b: float
    right_only_a: int  # right in run a, wrong in run b
    right_only_b: int
    mcnemar_p: float
    agree_polarity: float
    agree_doubt: float
    agree_expectation: float
    as_complaints_a: float | None
    as_complaints_b: float | None


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p: the discordant counts `b` and `c` against Binomial(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    return list(run["rows"]["labels"])


def pair(a: dict[str, Any], b: dict[str, Any]) -> Paired:
    """Run `a` against run `b` on their labelled rows (the same documents, in the same order)."""
    rows_a, rows_b = _rows(a), _rows(b)
    if [r["text"] for r in rows_a] != [r["text"] for r in rows_b]:
        raise ValueError("the two runs labelled different documents")
    right_a = [r["polarity"] == r["label"] for r in rows_a]
    right_b = [r["polarity"] == r["label"] for r in rows_b]
    only_a = sum(x and not y for x, y in zip(right_a, right_b, strict=True))
    only_b = sum(y and not x for x, y in zip(right_a, right_b, strict=True))
    n = len(rows_a)

    def agree(key: str) -> float:
        return sum(x[key] == y[key] for x, y in zip(rows_a, rows_b, strict=True)) / n

    def complaints(run: dict[str, Any]) -> float | None:
        return (run.get("as_complaints") or {}).get("all", {}).get("accuracy")

    return Paired(
        n, sum(right_a) / n, sum(right_b) / n, only_a, only_b, mcnemar_exact(only_a, only_b),
        agree("polarity"), agree("doubt"), agree("expectation"), complaints(a), complaints(b),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path, help="the reference run (e.g. uncompressed)")
    parser.add_argument("b", type=Path, help="the run compared with it")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON")
    args = parser.parse_args()
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    p = pair(a, b)

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    table = Table("n", "accuracy a", "accuracy b", "b - a (points)", "right only in a", "right only in b",
                  "McNemar p", "polarity =", "doubt =", "expectation =", "as complaints a", "as complaints b",
                  title=f"{args.a.name} (a) against {args.b.name} (b), polarity on real labelled data")  # fmt: skip
    table.add_row(str(p.n), f(p.accuracy_a), f(p.accuracy_b), f"{100 * (p.accuracy_b - p.accuracy_a):+.2f}",
                  str(p.right_only_a), str(p.right_only_b), f"{p.mcnemar_p:.3f}", f(p.agree_polarity),
                  f(p.agree_doubt), f(p.agree_expectation), f(p.as_complaints_a), f(p.as_complaints_b))  # fmt: skip
    Console(width=180).print(table)
    if args.out:
        args.out.write_text(json.dumps({"a": str(args.a), "b": str(args.b)} | asdict(p), indent=1) + "\n")


if __name__ == "__main__":
    main()
