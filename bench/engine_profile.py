"""Where the engine's time goes: the burst of `bench.engine_bench` (every request at t=0, EOS
ignored) run once under torch's profiler, each operator's own CPU time summed over the run and
grouped by what it does (weights' matrix products, attention's products, gathers and copies out of
the paged pool, softmax, element-wise work, sampling and the rest), for each dtype asked, each in
a process of its own.

    python -m bench.engine_profile --dtypes bfloat16,float32 --docs 16 --new-tokens 32 \
        --out bench/results/engine-profile-cpu.json

The profiler's own overhead inflates small operators; compare shares between dtypes and with
the engine bench's wall time, not the profiled wall time with an unprofiled one. `--replay N`
then times the weights' products inside one more unprofiled burst and replays the same products
alone N times in the same process: whether a product costs more inside a step than outside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import common

# operator name -> group (the first pattern contained in the name wins: specific ones first)
GROUPS = (
    ("index_put", "cache writes"),
    ("index_copy", "cache writes"),
    ("aten::topk", "sampling"),
    ("_linear_pointwise", "linear (weights)"),  # prepacked weights (engine/linear.py)
    ("aten::addmm", "linear (weights)"),
    ("aten::mm", "linear (weights)"),
    ("aten::linear", "linear (weights)"),
    ("aten::matmul", "linear (weights)"),
    ("aten::bmm", "attention products"),
    ("aten::baddbmm", "attention products"),
    ("scaled_dot_product", "attention products"),
    ("softmax", "softmax"),
    ("index_select", "gathers and copies"),
    ("aten::index", "gathers and copies"),
    ("aten::gather", "gathers and copies"),
    ("aten::copy_", "gathers and copies"),
    ("aten::cat", "gathers and copies"),
    ("aten::to", "gathers and copies"),
    ("aten::contiguous", "gathers and copies"),
    ("aten::clone", "gathers and copies"),
    ("aten::scatter", "cache writes"),
    ("aten::argmax", "sampling"),
    ("aten::sort", "sampling"),
    ("aten::mul", "element-wise"),
    ("aten::add", "element-wise"),
    ("aten::silu", "element-wise"),
    ("aten::pow", "element-wise"),
    ("aten::mean", "element-wise"),
    ("aten::rsqrt", "element-wise"),
    ("aten::neg", "element-wise"),
    ("aten::sub", "element-wise"),
    ("aten::div", "element-wise"),
    ("aten::embedding", "element-wise"),
)


def group_of(name: str) -> str:
    return next((group for pattern, group in GROUPS if pattern in name), "other")


def profile_child(args: Any) -> dict[str, Any]:
    """In this process: load the model, run the burst once unprofiled (warm-up) and once profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine_variants import engine_run, load_prompts
    from engine.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype)
    prompts = load_prompts(loaded.tokenizer, args.docs)
    at = [0.0] * len(prompts)
    pool = 1 << 30
    engine_run(loaded, prompts[:2], 4, [0.0, 0.0], True, args.max_batch, args.step_tokens, True, pool)
    plain = engine_run(
        loaded, prompts, args.new_tokens, at, True, args.max_batch, args.step_tokens, True, pool
    )
    # the engine steps on a thread of its own: the profiler must follow every thread
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        start = time.perf_counter()
        profiled = engine_run(
            loaded, prompts, args.new_tokens, at, True, args.max_batch, args.step_tokens, True, pool
        )
        wall = time.perf_counter() - start
    ops = [
        {"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    replay = replay_products(loaded, prompts, at, args) if args.replay else None
    return {
        "replay": replay,
        "dtype": str(loaded.dtype),
        "threads": torch.get_num_threads(),
        "tok_s": plain.tokens / plain.wall_s,
        "profiled_tok_s": profiled.tokens / wall,
        "profiled_wall_s": wall,
        "steps": profiled.extra["steps"],
        "mean_batch": profiled.extra["mean_batch"],
        "prompt_tokens": profiled.extra["prompt_tokens"],
        "ops": sorted(ops, key=lambda o: -o["self_s"]),
    }


def replay_products(loaded: Any, prompts: list[list[int]], at: list[float], args: Any) -> dict[str, Any]:
    """The burst once more with every packed product timed where it runs (a wrapper around
    `PackedLinear.forward`, no profiler), then the same products (same modules, same row counts,
    same order) replayed back to back outside the engine, `args.replay` times: whether a product
    costs more inside a step than alone. Seconds each; run in one process, minutes apart at most."""
    import torch

    from bench.engine_variants import engine_run
    from engine.linear import PackedLinear

    calls: list[tuple[PackedLinear, int]] = []
    inside = 0.0
    forward = PackedLinear.forward

    def timed(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        nonlocal inside
        start = time.perf_counter()
        out = forward(self, x)
        inside += time.perf_counter() - start
        calls.append((self, x.numel() // x.shape[-1]))
        return out

    PackedLinear.forward = timed  # type: ignore[method-assign]
    try:
        run = engine_run(
            loaded, prompts, args.new_tokens, at, True, args.max_batch, args.step_tokens, True, 1 << 30
        )
    finally:
        PackedLinear.forward = forward  # type: ignore[method-assign]
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    replayed = []
    with torch.inference_mode():
        for _ in range(args.replay):
            total = 0.0
            for module, rows in calls:
                shape = (rows, module.in_features)
                if shape not in inputs:
                    inputs[shape] = torch.randn(1, *shape, dtype=loaded.dtype)
                start = time.perf_counter()
                module(inputs[shape])
                total += time.perf_counter() - start
            replayed.append(total)
    return {"calls": len(calls), "wall_s": run.wall_s, "inside_s": inside, "replayed_s": replayed}


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--dtype", help="(a child: the one dtype)")
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=192)
    parser.add_argument(
        "--replay", type=int, default=0,
        help="after profiling, time the products inside the engine unprofiled and replay them this many times alone",
    )  # fmt: skip
    parser.add_argument("--child-out", type=Path, help="(a child: where its JSON goes)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine-profile.json"))
    args = parser.parse_args()
    args.model = common.model_path(args.model)
    if args.child_out is not None:
        args.child_out.write_text(json.dumps(profile_child(args)))
        return
    runs = []
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            subprocess.run(
                [sys.executable, "-m", "bench.engine_profile", "--dtype", dtype, "--docs", str(args.docs),
                 "--new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch),
                 "--step-tokens", str(args.step_tokens), "--model", str(args.model), "--child-out", str(out),
                 "--replay", str(args.replay)],
                check=True,
            )  # fmt: skip
            runs.append(json.loads(out.read_text()))
    console = Console(width=150)
    groups = sorted({group_of(op["name"]) for run in runs for op in run["ops"]})
    table = Table("group", *(f"{run['dtype']} s (share)" for run in runs),
                  title=f"engine burst, {args.docs} documents x {args.new_tokens} tokens: operators' own CPU time")  # fmt: skip
    for run in runs:
        total = sum(op["self_s"] for op in run["ops"])
        run["groups"] = {
            g: sum(op["self_s"] for op in run["ops"] if group_of(op["name"]) == g) for g in groups
        }
        run["ops_total_s"] = total
    for group in sorted(groups, key=lambda g: -runs[0]["groups"][g]):
        table.add_row(
            group, *(f"{r['groups'][group]:.1f} ({r['groups'][group] / r['ops_total_s']:.0%})" for r in runs)
        )
    table.add_row("all operators", *(f"{r['ops_total_s']:.1f}" for r in runs))
    table.add_row("wall, profiled", *(f"{r['profiled_wall_s']:.1f}" for r in runs))
    table.add_row("tok/s unprofiled", *(f"{r['tok_s']:.1f}" for r in runs))
    console.print(table)
    for run in runs:
        if run["replay"]:
            r = run["replay"]
            console.print(f"{run['dtype']}: {r['calls']} products, {r['inside_s']:.1f} s inside the engine "
                          f"(burst {r['wall_s']:.1f} s), replayed alone: "
                          + ", ".join(f"{t:.1f} s" for t in r["replayed_s"]))  # fmt: skip
        console.print(f"{run['dtype']}: top operators " + ", ".join(
            f"{op['name']} {op['self_s']:.1f} s" for op in run["ops"][:8]))  # fmt: skip
        run["ops"] = run["ops"][:40]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1)
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
