"""KV compression's throughput cost at equal batch size and equal work, in one run.

Every profile serves the same documents (evenly spaced over data/kv-corpus.jsonl, rendered as the
service renders them) with the same number of generated tokens each (greedy, EOS ignored), all
submitted at once to an engine with the same MAX_BATCH_SIZE and a pool large enough that no
request waits for blocks or is preempted (the table says if one was). Prefix caching is off by
default, as in `bench.kv_quality`: every document's blocks are its own, so the most KV is read.
The only difference between two runs is how KV blocks are stored and read.

Profiles: `off`; `int8` and `int4` (quantised blocks read by the native kernel, the engine's
default on CPU); `int4+int8@5` (int4, the five layers of `bench.kv_formats.SENSITIVE` at int8);
`int8-torch` and `int4-torch` (the same blocks read by torch alone: what the
kernel is worth; only when named in --profiles, except int8-torch, which runs by default);
`int4+int8@5-avx2` and `-portable`: the kernel built for an older CPU's path (KV_KERNEL=avx2,
portable), to measure on this CPU what a CPU without AVX-512 reads with.
This machine's timings vary by several per cent from run to run, so every profile runs in each
of --rounds rounds, back to back, in an order rotated from round to round; the cost is taken
within a round (1 - tokens/s over `off`'s tokens/s in that round) and the median round reported,
every run in the JSON. Its speed drifts within a run too (the weights' products, the same work in
every profile, took 9.6-12.2 s from one burst to the next in one quarter hour), so a second cost is
paced by them: each run's step time per second of the weights' products (`bench.engine_steps`'
timers), over `off`'s in the same round. What compression adds (quantising blocks, reading them)
shows in it; the machine's speed does not.

    python -m bench.kv_cost --out bench/results/kv-cost-cpu.json
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from bench.engine_steps import StepTimers, instrument
from bench.engine_variants import engine_run, prompt_ids
from bench.kv_formats import SENSITIVE, SIX_BIT_LAYERS, SIX_BIT_PARTS
from bench.kv_quality import load_corpus
from engine.config import KVKernel
from engine.loader import load_model


class Profile(NamedTuple):
    bits: int  # KV bits (16: uncompressed)
    kernel: KVKernel  # the reader
    int8_layers: tuple[int, ...] = ()  # layers kept at 8 bits
    int6_layers: tuple[int, ...] = ()  # layers kept at 6 bits
    int6_parts: tuple[str, ...] = ()  # parts kept at 6 bits
    prompt_tokens: int = 0  # KV_PROMPT_TOKENS: full-precision room for prompts being read


PROFILES: dict[str, Profile] = {
    "off": Profile(16, "auto"),
    "int8": Profile(8, "auto"),
    "int4": Profile(4, "auto"),
    "int4+int8@5": Profile(4, "auto", SENSITIVE),  # bench.kv_quality's profile of that name
    "int4+int8@5-avx2": Profile(4, "avx2", SENSITIVE),  # the kernel's AVX2 path (CPUs without AVX-512)
    "int4+int8@5-portable": Profile(4, "portable", SENSITIVE),  # its portable loop (no vector path)
    "int4+int6@10": Profile(4, "auto", (), SIX_BIT_LAYERS),  # the same bytes, 6 bits in ten layers
    "int4+int6@40parts": Profile(4, "auto", (), (), SIX_BIT_PARTS),  # the same bytes, 6 bits in forty parts
    # the forty parts, prompts read over a full-precision history (bench.kv_quality's -prompts2k)
    "int4+int6@40parts-prompts2k": Profile(4, "auto", (), (), SIX_BIT_PARTS, 2048),
    "int8-torch": Profile(8, "torch"),
    "int4-torch": Profile(4, "torch"),
}
DEFAULT_PROFILES = "off,int8,int4,int8-torch"


def rotated(names: list[str], round_: int) -> list[str]:
    """The profiles in the order round `round_` runs them: each round starts one later."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def costs(runs: list[dict[str, Any]], name: str) -> list[float]:
    """Per round: 1 - this profile's tokens/s over `off`'s in the same round."""
    return [1 - mine / off for mine, off in _pairs(runs, name, "tok_s")]


def paced_costs(runs: list[dict[str, Any]], name: str) -> list[float]:
    """Per round: this profile's step time per second of the weights' products over `off`'s, less 1.
    The products do the same work in every profile (the same tokens through the same weights), so
    their time measures how fast the machine ran that minute; this cost does not move with it."""
    return [mine / off - 1 for mine, off in _pairs(runs, name, "steps_per_product_s")]


def _pairs(runs: list[dict[str, Any]], name: str, key: str) -> list[tuple[float, float]]:
    """(this profile's `key`, `off`'s) in each round that ran both."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["profile"]] = r[key]
    return [(r[name], r["off"]) for _, r in sorted(by_round.items()) if {name, "off"} <= r.keys()]


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--profiles", default=DEFAULT_PROFILES, help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="auto: bf16 where the CPU computes it natively, else fp32")  # fmt: skip
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--prefix-caching", action="store_true", help="reuse shared prompt prefixes")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-cost.json"))
    args = parser.parse_args()
    names = [n for n in args.profiles.split(",") if n]
    if "off" not in names or any(n not in PROFILES for n in names):
        parser.error(f"--profiles must name off and only these: {', '.join(PROFILES)}")
    console = Console(width=150)
    args.model = common.model_path(args.model)
    loaded = load_model(args.model, dtype=args.dtype)
    prompts = [prompt_ids(loaded.tokenizer, doc) for doc in load_corpus(args.docs)]
    at = [0.0] * len(prompts)
    runs: list[dict[str, Any]] = []
    timers = StepTimers()
    undo = instrument(loaded.model, timers)
    try:
        for round_ in range(args.rounds):
            for name in rotated(names, round_):
                bits, kernel, int8_layers, int6_layers, int6_parts, prompt_tokens = PROFILES[name]
                timers.reset()
                timers.active = True
                run = engine_run(
                    loaded, prompts, args.new_tokens, at, True, args.max_batch, args.step_tokens,
                    args.prefix_caching, args.pool_mib << 20, bits, kernel, int8_layers,
                    kv_int6_layers=int6_layers, kv_int6_parts=int6_parts, kv_prompt_tokens=prompt_tokens,
                )  # fmt: skip
                timers.active = False
                steps, products = timers.total("whole step"), timers.total("weights' products")
                runs.append({"round": round_, "profile": name, **run.row(), "wall_s": run.wall_s,
                             "tokens": run.tokens, "steps_s": steps, "products_s": products,
                             "steps_per_product_s": steps / products, "extra": run.extra})  # fmt: skip
                console.print(
                    f"round {round_} {name}: {runs[-1]['tok_s']:.1f} tok/s, p95 {runs[-1]['p95_s']:.1f} s, "
                    f"steps {steps:.1f} s of which the weights' products {products:.1f} s"
                )
                write(args, names, runs)
    finally:
        for call in undo:
            call()

    table = Table("profile", "reader", "tok/s (median)", "tok/s range", "cost vs off (median round)",
                  "cost per round", "paced cost (median round)", "paced per round", "p95 s", "mean batch",
                  "preemptions",
                  title=f"KV compression cost, {len(prompts)} documents x {args.new_tokens} tokens, "
                        f"batch {args.max_batch}, prefix caching {'on' if args.prefix_caching else 'off'}")  # fmt: skip
    for name in names:
        mine = [r for r in runs if r["profile"] == name]
        rates = [r["tok_s"] for r in mine]
        cost = costs(runs, name) if name != "off" else []
        paced = paced_costs(runs, name) if name != "off" else []
        table.add_row(
            name, str(mine[0]["extra"].get("kv_reader") or "-"), f"{statistics.median(rates):.1f}",
            f"{min(rates):.1f}-{max(rates):.1f}", f"{statistics.median(cost):.1%}" if cost else "-",
            " ".join(f"{c:.1%}" for c in cost) or "-", f"{statistics.median(paced):.1%}" if paced else "-",
            " ".join(f"{c:.1%}" for c in paced) or "-", f"{statistics.median(r['p95_s'] for r in mine):.1f}",
            f"{statistics.median(r['extra']['mean_batch'] for r in mine):.2f}",
            str(sum(r["extra"]["preemptions"] for r in mine)),
        )  # fmt: skip
    console.print(table)
    console.print(f"wrote {args.out}")


def write(args: Any, names: list[str], runs: list[dict[str, Any]]) -> None:
    summary = {}
    for name in (n for n in names if n != "off"):
        rates, cost = [r["tok_s"] for r in runs if r["profile"] == name], costs(runs, name)
        paced = paced_costs(runs, name)
        if rates:
            summary[name] = {"tok_s_median": statistics.median(rates), "cost_per_round": cost,
                             "cost_median": statistics.median(cost) if cost else None,
                             "paced_cost_per_round": paced,
                             "paced_cost_median": statistics.median(paced) if paced else None}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "summary": summary, "runs": runs,
    }, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
