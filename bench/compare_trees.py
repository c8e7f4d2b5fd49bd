"""The engine's tokens/s in two checkouts of this repository, alternating, in one run: did a change
(a refactor, a new step) move the engine's speed?

Each round runs the engine on the burst (`bench.engine_bench --part`, every request at t=0) in a
fresh process of each checkout, the order rotating from round to round (each checkout first in
turn), for each variant named. The ratio after/before is taken within each round (this
machine's timings drift by several per cent over minutes) and the median round is reported.
With `--aa`, each round also runs the `before` checkout a second time ("again"): the spread of
again/before, identical code, is this machine's noise between processes, the yardstick for
after/before.

A variant may be named differently in each checkout, `before:after` (e.g.
`engine_dynamic:engine_dynamic_unpacked`: the old checkout's engine against the new one's with a
later, separate speed-up turned off). `--dtype` is passed to both: checkouts whose default dtypes
differ (older ones defaulted to bf16) are otherwise not running the same arithmetic. Both run the
same token ids, this checkout's prompts for the corpus (`--prompt-ids`, kept beside `--out`; a checkout whose
bench lacks the option needs it added to its `bench.engine_bench`): prompts rendered by each
checkout's own templates would differ in length, and tokens/s with them.

    python -m bench.compare_trees --before ../main --after . --rounds 3 \
        --out bench/results/compare-structure-cpu.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from bench import common
from bench.engine_variants import load_prompts


def burst(tree: Path, variant: str, args: Any) -> dict[str, Any]:
    """One engine burst run in `tree`'s code: its run record."""
    dtype = ["--dtype", args.dtype] if args.dtype else []
    dtype += ["--prompt-ids", str(args.prompt_ids)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        subprocess.run(
            [sys.executable, "-m", "bench.engine_bench", "--no-isolate", "--part", "--variants", variant,
             "--scenarios", "burst", "--no-ttft-isolation", "--repeats", "1", "--docs", str(args.docs),
             "--new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch),
             "--model", str(args.model), *dtype, "--out", str(out)],
            check=True, cwd=tree,
        )  # fmt: skip
        runs = json.loads(out.read_text())["runs"]
    return dict(next(r for r in runs if r["variant"] == variant))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--before", type=Path, required=True, help="the checkout measured as the baseline")
    parser.add_argument("--after", type=Path, default=Path("."), help="the checkout with the change")
    parser.add_argument("--variants", default="engine_dynamic,engine_dynamic_int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="passed to both checkouts")
    parser.add_argument("--aa", action="store_true", help="also run `before` twice a round (the noise)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/compare-trees.json"))
    args = parser.parse_args()
    args.model = common.model_path(args.model)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    args.prompt_ids = args.out.with_suffix(".prompts.json").resolve()
    args.prompt_ids.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.prompt_ids.write_text(json.dumps(load_prompts(tokenizer, args.docs)))
    if args.aa:
        trees["again"] = trees["before"]
    commits = {
        name: subprocess.run(
            ["git", "describe", "--always", "--dirty"],  # noqa: S607 - git from PATH
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        for name, tree in trees.items()
    }
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        names = list(trees)
        order = names[round_ % len(names) :] + names[: round_ % len(names)]  # each first in turn
        for variant in args.variants.split(","):
            for name in order:
                run = burst(trees[name], named_in(variant, name), args)
                rate = run["tokens"] / run["wall_s"]
                rows.append({"round": round_, "variant": variant, "tree": name, "tokens_per_s": rate})
                print(f"round {round_} {variant} {name}: {rate:.1f} tokens/s", flush=True)
    summary: dict[str, Any] = {}
    table = Table(title=f"engine burst, {args.docs} documents x {args.new_tokens} tokens: after / before")
    for column in ("variant", "before tok/s (median)", "after tok/s (median)", "ratio per round", "median"):
        table.add_column(column)
    for variant in args.variants.split(","):
        rate = {(r["round"], r["tree"]): r["tokens_per_s"] for r in rows if r["variant"] == variant}
        ratios = [rate[(i, "after")] / rate[(i, "before")] for i in range(args.rounds)]
        before = statistics.median(rate[(i, "before")] for i in range(args.rounds))
        after = statistics.median(rate[(i, "after")] for i in range(args.rounds))
        summary[variant] = {
            "before": before,
            "after": after,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
        }
        table.add_row(variant, f"{before:.1f}", f"{after:.1f}", " ".join(f"{r:.3f}" for r in ratios),
                      f"{statistics.median(ratios):.3f}")  # fmt: skip
        if args.aa:
            noise = [rate[(i, "again")] / rate[(i, "before")] for i in range(args.rounds)]
            summary[variant] |= {"again_ratios": noise, "again_median_ratio": statistics.median(noise)}
            table.add_row(f"{variant} (before again: noise)", f"{before:.1f}", "",
                          " ".join(f"{r:.3f}" for r in noise), f"{statistics.median(noise):.3f}")  # fmt: skip
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commits": commits, "config": {k: str(v) for k, v in vars(args).items()},
                                    "runs": rows, "summary": summary}, indent=1))  # fmt: skip
    print(f"wrote {args.out}")


def named_in(variant: str, tree: str) -> str:
    """The variant's name in one checkout: `before:after` names it per checkout, else one name."""
    before, _, after = variant.partition(":")
    return after if tree == "after" and after else before


if __name__ == "__main__":
    main()
