"""Engine benchmark: the same analysis prompts through five ways of serving them, in one run.

Variants (same prompts, same number of generated tokens per request with EOS ignored, same
threads, greedy):
  1. hf_generate_1       `model.generate`, one request at a time
  2. hf_generate_static4 `model.generate`, static batches of 4 with left padding
  3. hf_generate_batch   transformers' own continuous batching (`generate_batch`), all at once
  4. engine_static       our engine, DYNAMIC_BATCHING=false
  5. engine_dynamic      our engine, DYNAMIC_BATCHING=true
  6. engine_dynamic_noprefix  the same with prefix caching off: how much of (5) the shared
     instruction prefix of the analysis prompts is worth
  7. engine_dynamic_int8, engine_dynamic_int4  (5) with KV_COMPRESSION on at 8 or 4 bits (only
     when named in --variants): the throughput cost of quantised KV blocks at equal batch size
  8. engine_dynamic_unpacked  (5) with PREPACK_WEIGHTS=false (only when named in --variants): what
     reordering the bf16 weights once for oneDNN is worth (no difference in fp32)
  9. engine_dynamic_unfused  (5) with FUSE_LAYERS=false (only when named in --variants): what
     RMSNorm and SiLU * up by the native kernels are worth (`engine.fused`)
 10. engine_dynamic_deferred  (5) with DECODE_DEFER_STEPS=16 (only when named in --variants): decodes
     give way to waiting prompts for up to 16 steps in a row, so a burst's prompts are read first
 11. engine_dynamic_sdpa  (5) with PROMPT_ATTENTION=torch (only when named in --variants): prompt
     chunks by SDPA over a gathered copy, what attending them in place by the native kernel is worth
Scenarios: `burst` (every request arrives at t=0) and `stream` (open-loop Poisson arrivals; the
one-at-a-time generate serves them in arrival order; static batches and `generate_batch` cannot
take a stream and run the burst only).
Plus `ttft_isolation`: a short request's time to first token alone vs while long prompts prefill.
Each variant runs in a fresh process of its own (`--no-isolate`: all in this one), so none inherits
another's heap: `generate_batch` alone grows this process past 10 GiB.
This machine's timings vary by several per cent from run to run, so the runs the headline ratios
rest on (one-at-a-time `generate`, our engine, unpacked, unfused, deferred and SDPA prompts on the
burst, and the TTFT isolation) run in
`--repeats` rounds, each round's two runs back to back (in reverse order every other round): the
ratio is taken within each round and the report gives the median round (and every round in the
JSON); the table shows each variant's median run. Every other run happens once.
On a GPU host, `--random-shape llama3-8b --tokenizer DIR` runs a Llama-3-8B-shaped model with
random weights (`bench.random_model`: real speed and KV bytes, no download); `bench/cuda_check.sh`
is the prepared GPU run.

    python -m bench.engine_bench --docs 32 --new-tokens 96 --out bench/results/engine-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from bench.engine_variants import (
    DEFERRED_STEPS,
    DEFERRED_VARIANTS,
    ENGINE_VARIANTS,
    SDPA_VARIANTS,
    UNFUSED_VARIANTS,
    UNPACKED_VARIANTS,
    WARM_UP_IDS,
    PeakRSS,
    Run,
    arrivals,
    engine_run,
    hf_generate,
    hf_generate_batch,
    load_prompts,
    ttft_isolation,
)
from bench.random_model import SHAPES, build_random
from engine import EngineConfig
from engine.config import KVKernel
from engine.fused import NativeRMSNorm
from engine.linear import PackedLinear
from engine.loader import LoadedModel, load_model, select_device, select_dtype


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


VARIANTS = ("hf_generate_1", "hf_generate_static4", "hf_generate_batch", *ENGINE_VARIANTS)
BURST_ONLY = ("hf_generate_static4", "hf_generate_batch")  # they cannot take a stream
# Repeated: the ratios rest on them (the unpacked variant's against engine_dynamic).
HEADLINE = (("hf_generate_1", "burst"), ("engine_dynamic", "burst"), ("engine_dynamic_unpacked", "burst"),
            ("engine_dynamic_unfused", "burst"), ("engine_dynamic_deferred", "burst"),
            ("engine_dynamic_sdpa", "burst"))  # fmt: skip


def planned(variants: list[str], scenarios: list[str]) -> list[tuple[str, str]]:
    """(variant, scenario) in the order they run."""
    return [
        (v, scenario)
        for scenario in ("burst", "stream")
        if scenario in scenarios
        for v in VARIANTS
        if v in variants and (scenario == "burst" or v not in BURST_ONLY)
    ]


def schedule(variants: list[str], scenarios: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(round, variant, scenario) in the order they run: everything in round 0, then the headline
    runs again in each further round, in reverse order in the odd rounds (a machine that drifts
    slower or faster over a round then favours neither side of a ratio in the median)."""
    first = planned(variants, scenarios)
    again = [pair for pair in first if pair in HEADLINE]
    return [(0, *pair) for pair in first] + [
        (r, *pair) for r in range(1, repeats) for pair in (again[::-1] if r % 2 else again)
    ]


def median_run(runs: list[Run]) -> Run:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.tokens / r.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def in_child(args: Any, variants: str, scenarios: str, isolation: bool) -> dict[str, Any]:
    """Runs part of the benchmark in a fresh interpreter; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        options = ["--dtype", args.dtype, "--docs", str(args.docs),
                   "--new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch),
                   "--step-tokens", str(args.step_tokens), "--rate", str(args.rate),
                   "--kv-cache-mib", str(args.kv_cache_mib), "--kv-kernel", args.kv_kernel,
                   "--decode-defer", str(args.decode_defer)]  # fmt: skip
        if args.saturated_step_tokens is not None:
            options += ["--saturated-step-tokens", str(args.saturated_step_tokens)]
        if args.speculative_tokens is not None:
            options += ["--speculative-tokens", str(args.speculative_tokens)]
        if args.speculative_step_tokens is not None:
            options += ["--speculative-step-tokens", str(args.speculative_step_tokens)]
        options += ["--prompt-ids", str(args.prompt_ids)] if args.prompt_ids else []
        if args.random_shape:
            options += ["--random-shape", args.random_shape, "--tokenizer", str(args.tokenizer)]
            options += ["--layers", str(args.layers)] if args.layers is not None else []
        else:
            options += ["--model", str(args.model)]
        subprocess.run(
            [sys.executable, "-m", "bench.engine_bench", "--no-isolate", "--part", "--variants", variants,
             "--scenarios", scenarios, "--ttft-isolation" if isolation else "--no-ttft-isolation",
             "--out", str(out), *options],
            check=True,
        )  # fmt: skip
        return dict(json.loads(out.read_text()))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--step-tokens", type=int, default=EngineConfig.model_fields["max_tokens_per_step"].default
    )
    parser.add_argument(
        "--saturated-step-tokens", type=int,
        default=EngineConfig.model_fields["saturated_tokens_per_step"].default,
        help="the engine's SATURATED_TOKENS_PER_STEP: the budget while a full batch is running or waiting "
        "(unset: twice --step-tokens, the engine's default; 0: --step-tokens always)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-tokens", type=int, default=None,
        help="the engine's SPECULATIVE_TOKENS: draft tokens per decode by prompt lookup (unset: the default)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-step-tokens", type=int, default=None,
        help="the engine's SPECULATIVE_STEP_TOKENS: the most tokens, decodes and their guesses, a step of "
        "decodes alone carries (0: its budget; unset: the default)",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=0.5, help="stream arrivals per second")
    parser.add_argument(
        "--variants",
        default="hf_generate_1,hf_generate_static4,hf_generate_batch,engine_static,engine_dynamic,"
        "engine_dynamic_noprefix",
    )
    parser.add_argument("--scenarios", default="burst,stream")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the headline runs (medians)")
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=True, help="a fresh process per variant"
    )
    parser.add_argument("--ttft-isolation", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--warm-up", action="store_true", help="first one short request unmeasured (as servers get)"
    )
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="the engine's KV pool")
    parser.add_argument(
        "--kv-kernel", choices=get_args(KVKernel), default="auto",
        help="the engine's KV_KERNEL: torch gathers decodes' history instead of reading it in place",
    )  # fmt: skip
    parser.add_argument(
        "--decode-defer", type=int, default=EngineConfig.model_fields["decode_defer_steps"].default,
        help=f"the engine's DECODE_DEFER_STEPS (engine_dynamic_deferred: always {DEFERRED_STEPS})",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-ids", type=Path,
        help="a JSON list of prompts as token ids, the workload instead of the corpus's (its first --docs): "
        "the same ids for checkouts whose prompts differ (bench.compare_trees)",
    )  # fmt: skip
    parser.add_argument(
        "--random-shape", choices=sorted(SHAPES), help="a model of this shape with random weights (GPU hosts)"
    )
    parser.add_argument("--tokenizer", type=Path, help="with --random-shape: a model folder's tokenizer")
    parser.add_argument("--layers", type=int, help="with --random-shape: fewer layers (a smoke test)")
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child: JSON only
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    console = Console(width=150)
    if args.random_shape and args.tokenizer is None:
        parser.error("--random-shape needs --tokenizer (a local model folder with a tokenizer)")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    args.model = None if args.random_shape else common.model_path(args.model)
    variants = args.variants.split(",")
    isolating = args.ttft_isolation and "engine_dynamic" in variants
    rounds = schedule(variants, args.scenarios.split(","), 1 if args.part else args.repeats)
    if args.isolate:
        fields = {f.name for f in dataclasses.fields(Run)}
        runs = []
        for round_, variant, scenario in rounds:
            for r in in_child(args, variant, scenario, False)["runs"]:
                runs.append(Run(**{k: v for k, v in r.items() if k in fields} | {"round": round_}))
        isolation = (
            [iso | {"round": round_} for round_ in range(args.repeats)
             for iso in in_child(args, "engine_dynamic", "none", True)["ttft_isolation"]]
            if isolating else []
        )  # fmt: skip
        report(args, runs, isolation, console)
        return
    if args.random_shape:
        device = select_device("auto")
        loaded = build_random(
            args.random_shape, args.tokenizer, device, select_dtype(args.dtype, device), args.layers
        )
    else:  # a run of unpacked variants alone (a child) loads the model unpacked
        loaded = load_model(
            args.model, dtype=args.dtype, prepack_weights=not set(variants) <= UNPACKED_VARIANTS,
            fuse_layers=not set(variants) <= UNFUSED_VARIANTS,
        )  # fmt: skip
    # without isolation, a second copy for the unpacked (or unfused) variants
    plain: dict[str, LoadedModel] = {}
    pool = args.kv_cache_mib * 2**20
    if args.prompt_ids:
        prompts = [list(map(int, p)) for p in json.loads(args.prompt_ids.read_text())][: args.docs]
    else:
        prompts = load_prompts(loaded.tokenizer, args.docs)
    n = args.new_tokens
    at = {"burst": [0.0] * len(prompts), "stream": arrivals(len(prompts), args.rate)}

    def variant_run(variant: str, scenario: str) -> Run:
        if variant == "hf_generate_1":
            return hf_generate(loaded, prompts, n, at[scenario], 1)
        if variant == "hf_generate_static4":
            return hf_generate(loaded, prompts, n, at[scenario], 4)
        if variant == "hf_generate_batch":
            return hf_generate_batch(loaded, prompts, n)
        dynamic, prefix, bits = ENGINE_VARIANTS[variant]
        model = loaded
        if variant in UNPACKED_VARIANTS and any(isinstance(m, PackedLinear) for m in loaded.model.modules()):
            if "unpacked" not in plain:
                plain["unpacked"] = load_model(args.model, dtype=args.dtype, prepack_weights=False)
            model = plain["unpacked"]
        if variant in UNFUSED_VARIANTS and any(isinstance(m, NativeRMSNorm) for m in loaded.model.modules()):
            if "unfused" not in plain:
                plain["unfused"] = load_model(args.model, dtype=args.dtype, fuse_layers=False)
            model = plain["unfused"]
        defer = DEFERRED_STEPS if variant in DEFERRED_VARIANTS else args.decode_defer
        return engine_run(
            model, prompts, n, at[scenario], dynamic, args.max_batch, args.step_tokens, prefix, pool, bits,
            kv_kernel=args.kv_kernel, decode_defer_steps=defer,
            prompt_attention="torch" if variant in SDPA_VARIANTS else "auto",
            saturated_tokens_per_step=args.saturated_step_tokens, speculative_tokens=args.speculative_tokens,
            speculative_step_tokens=args.speculative_step_tokens,
        )  # fmt: skip

    cuda = loaded.device.type == "cuda"
    if cuda:  # one-off CUDA start-up costs (cuBLAS, kernels) go unmeasured
        hf_generate(loaded, prompts[:1], 4, [0.0], 1)
        engine_run(loaded, prompts[:2], 4, [0.0, 0.0], True, args.max_batch, args.step_tokens, True, pool)
    elif args.warm_up:
        engine_run(loaded, [WARM_UP_IDS], 8, [0.0], True, args.max_batch, args.step_tokens, True, pool)
    runs = []
    for round_, name, scenario in rounds:
        console.print(f"running {name} / {scenario}{f' (round {round_ + 1})' if round_ else ''} ...")
        if cuda:
            torch.cuda.reset_peak_memory_stats(loaded.device)
        with PeakRSS() as rss:
            run = variant_run(name, scenario)
        run.variant, run.scenario, run.peak_rss_mib, run.round = name, scenario, rss.mib, round_
        if cuda:
            run.extra["cuda_peak_mib"] = torch.cuda.max_memory_allocated(loaded.device) / 2**20
        runs.append(run)
        console.print(f"  {run.row()['tok_s']:.1f} tok/s in {run.wall_s:.1f} s")
    isolation = []
    if isolating:
        for round_ in range(1 if args.part else args.repeats):
            isolation += [ttft_isolation(loaded, args.max_batch, args.step_tokens, p, kv_cache_bytes=pool,
                                         saturated_tokens_per_step=args.saturated_step_tokens) | {"round": round_}
                          for p in (True, False)]  # fmt: skip
    report(args, runs, isolation, console)


def report(args: Any, runs: list[Run], isolation: list[dict[str, Any]], console: Console) -> None:
    """The table, the ratios and the JSON (a child process writes the JSON only)."""
    if args.part:
        args.out.write_text(
            json.dumps({"runs": [asdict(r) for r in runs], "ttft_isolation": isolation}, default=str)
        )
        return
    n = args.new_tokens
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.variant, run.scenario), []).append(run)
    medians = {key: median_run(group) for key, group in groups.items()}
    table = Table("variant", "scenario", "runs", "tok/s", "req/s", "p50 s", "p95 s", "TTFT p50", "TTFT p95", "peak RSS MiB", "KV MiB",
                  title=f"{args.docs} documents x {n} tokens, {args.dtype}, {torch.get_num_threads()} threads "
                        "(the median run of each)")  # fmt: skip
    for key, run in medians.items():
        r, spread = run.row(), sorted(x.tokens / x.wall_s for x in groups[key])
        tok = f"{r['tok_s']:.1f}" + (f" ({spread[0]:.1f}-{spread[-1]:.1f})" if len(spread) > 1 else "")
        table.add_row(r["variant"], r["scenario"], str(len(spread)), tok, f"{r['req_s']:.3f}", f"{r['p50_s']:.1f}",
                      f"{r['p95_s']:.1f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p95_s']:.2f}", f"{r['peak_rss_mib']:.0f}",
                      "-" if r["kv_mib"] is None else f"{r['kv_mib']:.0f}")  # fmt: skip
    console.print(table)

    def tok_s(variant: str, scenario: str, round_: int | None = None) -> float | None:
        """A run's tokens/s: of the given round, else the variant's median run."""
        if round_ is None:
            run = medians.get((variant, scenario))
        else:
            run = next((r for r in groups.get((variant, scenario), []) if r.round == round_), None)
        return None if run is None else run.tokens / run.wall_s

    # The headline ratio within each round (its two runs back to back), then the median round.
    rounds: dict[str, list[float]] = {}
    for round_ in sorted({r.round for r in runs}):
        ours = tok_s("engine_dynamic", "burst", round_)
        for other in (v for v, _ in HEADLINE if v != "engine_dynamic"):
            base = tok_s(other, "burst", round_)
            if ours is not None and base is not None:
                rounds.setdefault(f"burst: engine_dynamic / {other} tok/s", []).append(ours / base)
    ratios = {key: _median(values) for key, values in rounds.items()}
    for key, (num, den) in {
        "stream: engine_dynamic / hf_generate_1 tok/s": (("engine_dynamic", "stream"), ("hf_generate_1", "stream")),
        "burst: engine_dynamic / hf_generate_batch tok/s": (("engine_dynamic", "burst"), ("hf_generate_batch", "burst")),
        "burst: engine_dynamic / engine_dynamic_noprefix tok/s": (("engine_dynamic", "burst"), ("engine_dynamic_noprefix", "burst")),
        "stream: engine_dynamic / engine_dynamic_noprefix tok/s": (("engine_dynamic", "stream"), ("engine_dynamic_noprefix", "stream")),
    }.items():  # fmt: skip
        a, b = tok_s(*num), tok_s(*den)
        if a is not None and b is not None:
            ratios[key] = a / b
    for key, value in ratios.items():
        each = (
            f" (rounds: {', '.join(f'{v:.2f}x' for v in rounds[key])})"
            if len(rounds.get(key, [])) > 1
            else ""
        )
        console.print(f"{key}: {value:.2f}x{each}")
    for iso in isolation:
        console.print(f"TTFT isolation, prefix caching {'on' if iso['prefix_caching'] else 'off'}, round {iso['round'] + 1}: "
                      f"short request ({iso['short_prompt_tokens']} tokens) p95 alone {iso['solo_p95_s']:.2f} s, during long "
                      f"prefills {iso['busy_p95_s']:.2f} s ({iso['ratio']:.2f}x)")  # fmt: skip
    isolation_median = {
        ("prefix caching on" if on else "prefix caching off"): _median(
            [iso["ratio"] for iso in isolation if iso["prefix_caching"] == on]
        )
        for on in sorted({iso["prefix_caching"] for iso in isolation}, reverse=True)
    }
    for key, value in isolation_median.items():
        console.print(f"TTFT isolation, {key}: median ratio {value:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "runs": [asdict(r) | {"summary": r.row()} for r in runs], "ratios": ratios, "ratio_rounds": rounds,
        "ttft_isolation": isolation, "ttft_isolation_median_ratio": isolation_median,
    }, indent=2, default=str))  # fmt: skip
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
