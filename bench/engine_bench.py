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
Scenarios: `burst` (every request arrives at t=0) and `stream` (open-loop Poisson arrivals; the
one-at-a-time generate serves them in arrival order; static batches and `generate_batch` cannot
take a stream and run the burst only).
Plus `ttft_isolation`: a short request's time to first token alone vs while long prompts prefill.
Each variant runs in a fresh process of its own (`--no-isolate`: all in this one), so none inherits
another's heap: `generate_batch` alone grows this process past 10 GiB.

    python -m bench.engine_bench --docs 32 --new-tokens 96 --out bench/results/engine-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from engine import Engine, EngineConfig, SamplingParams
from engine.loader import LoadedModel, load_model
from prompts import render
from schemas import DocumentKind, Language

CORPUS = Path(__file__).with_name("data") / "corpus.jsonl"


@dataclass
class Run:
    variant: str
    scenario: str
    wall_s: float
    tokens: int
    latencies_s: list[float]
    ttfts_s: list[float]
    peak_rss_mib: float
    kv_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "scenario": self.scenario,
            "tok_s": self.tokens / self.wall_s,
            "req_s": len(self.latencies_s) / self.wall_s,
            "p50_s": _pct(self.latencies_s, 50),
            "p95_s": _pct(self.latencies_s, 95),
            "ttft_p50_s": _pct(self.ttfts_s, 50),
            "ttft_p95_s": _pct(self.ttfts_s, 95),
            "peak_rss_mib": self.peak_rss_mib,
            "kv_mib": None if self.kv_bytes is None else self.kv_bytes / 2**20,
        }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class PeakRSS:
    """Samples this process's resident memory while a variant runs (ru_maxrss is process-wide)."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mib(self) -> float:
        return self.peak / 2**20


def load_prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    docs = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(7)
    rng.shuffle(docs)  # a deterministic mix of kinds, languages and lengths
    prompts = []
    for doc in docs[:count]:
        prompt = render(DocumentKind(doc["kind"]), Language(doc["language"]), doc["text"])
        ids = loaded.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def arrivals(n: int, rate: float, seed: int = 11) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class _FirstToken:
    """A generate() streamer that records when the first new token of each row appears."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(loaded: LoadedModel, prompts: list[list[int]], n: int, at: list[float], batch: int) -> Run:
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    model.set_attn_implementation("sdpa")
    latencies, ttfts = [], []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        ready = max(at[i : i + batch])  # a static batch starts once all its requests are there
        if (wait := start + ready - time.perf_counter()) > 0:
            time.sleep(wait)
        longest = max(map(len, group))
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group])
        streamer = _FirstToken()
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=pad, streamer=streamer,
        )  # fmt: skip
        done = time.perf_counter()
        for j in range(len(group)):
            latencies.append(done - start - at[i + j])
            ttfts.append((streamer.first or done) - start - at[i + j])
    wall = time.perf_counter() - start
    name = "hf_generate_1" if batch == 1 else f"hf_generate_static{batch}"
    return Run(name, "", wall, n * len(prompts), latencies, ttfts, 0.0)


def hf_generate_batch(loaded: LoadedModel, prompts: list[list[int]], n: int) -> Run:
    from transformers import GenerationConfig

    model, tok = loaded.model, loaded.tokenizer
    config = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    # generate_batch returns all results together; per-request latency is the batch's wall time.
    return Run("hf_generate_batch", "burst", wall, tokens, [wall] * len(prompts), [float("nan")] * len(prompts),
               0.0, extra={"note": "no per-request timings from generate_batch"})  # fmt: skip


def engine_run(
    loaded: LoadedModel,
    prompts: list[list[int]],
    n: int,
    at: list[float],
    dynamic: bool,
    max_batch: int,
    budget: int,
    prefix_caching: bool = True,
) -> Run:
    async def go() -> Run:
        config = EngineConfig(
            model_path=Path("bench"), dynamic_batching=dynamic, max_batch_size=max_batch,
            kv_cache_bytes=1 << 30, max_tokens_per_step=budget, prefix_caching=prefix_caching,
        )  # fmt: skip
        engine = Engine(config, loaded)
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        async with engine:
            start = time.perf_counter()

            async def one(ids: list[int], delay: float) -> Any:
                await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
                return await engine.generate(ids, params)

            results = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, at, strict=True)))
            wall = time.perf_counter() - start
            stats = engine.stats()
        return Run(
            "", "", wall, sum(r.output_tokens for r in results),
            [r.total_s for r in results], [r.ttft_s for r in results], 0.0, stats.kv_total_bytes,
            {"mean_batch": stats.mean_batch_size, "largest_batch": stats.largest_batch, "steps": stats.num_steps,
             "prefix_hit_tokens": stats.prefix_hit_tokens, "prompt_tokens": sum(map(len, prompts))},
        )  # fmt: skip

    return asyncio.run(go())


def ttft_isolation(
    loaded: LoadedModel, max_batch: int, budget: int, prefix_caching: bool, reps: int = 10
) -> dict[str, Any]:
    """A short request's TTFT alone, then arriving while long prompts are being prefilled.

    One unmeasured solo run first, so that with prefix caching both measurements see the same
    warm cache (the short request's instruction prefix already computed). Every repetition's
    long prompts are documents not seen before (a cached prompt would not be prefilling), and
    the short request arrives at a random point of the long prefills (seeded), so the p95
    covers arrivals at any phase of a step."""
    prompts = sorted(load_prompts(loaded, 60), key=len)
    short, longs = prompts[0], prompts[-4 * reps :]
    rng = random.Random(3)

    async def go() -> dict[str, Any]:
        config = EngineConfig(
            model_path=Path("bench"), dynamic_batching=True, max_batch_size=max_batch,
            kv_cache_bytes=1 << 30, max_tokens_per_step=budget, prefix_caching=prefix_caching,
        )  # fmt: skip
        async with Engine(config, loaded) as engine:
            await engine.generate(short, SamplingParams(max_new_tokens=4))
            solo = [
                (await engine.generate(short, SamplingParams(max_new_tokens=4))).ttft_s for _ in range(reps)
            ]
            busy, offsets = [], []
            for rep in range(reps):
                group = longs[rep::reps]  # 4 of the 40 longest documents, each used once
                background = [
                    engine.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in group
                ]
                offsets.append(rng.uniform(0.3, 1.5))  # the long prompts are mid-prefill
                await asyncio.sleep(offsets[-1])
                busy.append((await engine.generate(short, SamplingParams(max_new_tokens=4))).ttft_s)
                await asyncio.gather(*(h.result() for h in background))
        return {
            "prefix_caching": prefix_caching, "step_tokens": budget, "short_prompt_tokens": len(short),
            "long_prompt_tokens": [len(p) for p in longs], "arrival_offsets_s": offsets,
            "solo_ttft_s": solo, "busy_ttft_s": busy,
            "solo_p95_s": _pct(solo, 95), "busy_p95_s": _pct(busy, 95), "ratio": _pct(busy, 95) / _pct(solo, 95),
        }  # fmt: skip

    return asyncio.run(go())


VARIANTS = ("hf_generate_1", "hf_generate_static4", "hf_generate_batch", "engine_static", "engine_dynamic",
            "engine_dynamic_noprefix")  # fmt: skip
BURST_ONLY = ("hf_generate_static4", "hf_generate_batch")  # they cannot take a stream


def planned(variants: list[str], scenarios: list[str]) -> list[tuple[str, str]]:
    """(variant, scenario) in the order they run."""
    return [
        (v, scenario)
        for scenario in ("burst", "stream")
        if scenario in scenarios
        for v in VARIANTS
        if v in variants and (scenario == "burst" or v not in BURST_ONLY)
    ]


def in_child(args: Any, variants: str, scenarios: str, isolation: bool) -> dict[str, Any]:
    """Runs part of the benchmark in a fresh interpreter; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        options = ["--model", str(args.model), "--dtype", args.dtype, "--docs", str(args.docs),
                   "--new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch),
                   "--step-tokens", str(args.step_tokens), "--rate", str(args.rate)]  # fmt: skip
        subprocess.run(  # noqa: S603 (this interpreter, this module)
            [sys.executable, "-m", "bench.engine_bench", "--no-isolate", "--part", "--variants", variants,
             "--scenarios", scenarios, "--ttft-isolation" if isolation else "--no-ttft-isolation",
             "--out", str(out), *options],
            check=True,
        )  # fmt: skip
        return dict(json.loads(out.read_text()))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=EngineConfig.max_tokens_per_step)
    parser.add_argument("--rate", type=float, default=0.5, help="stream arrivals per second")
    parser.add_argument(
        "--variants",
        default="hf_generate_1,hf_generate_static4,hf_generate_batch,engine_static,engine_dynamic,"
        "engine_dynamic_noprefix",
    )
    parser.add_argument("--scenarios", default="burst,stream")
    parser.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=True, help="a fresh process per variant"
    )
    parser.add_argument("--ttft-isolation", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child: JSON only
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = parser.parse_args()
    console = Console(width=150)
    args.model = common.model_path(args.model)
    variants = args.variants.split(",")
    isolating = args.ttft_isolation and "engine_dynamic" in variants
    if args.isolate:
        fields = {f.name for f in dataclasses.fields(Run)}
        runs = [
            Run(**{k: v for k, v in r.items() if k in fields})
            for variant, scenario in planned(variants, args.scenarios.split(","))
            for r in in_child(args, variant, scenario, False)["runs"]
        ]
        isolation = in_child(args, "engine_dynamic", "none", True)["ttft_isolation"] if isolating else []
        report(args, runs, isolation, console)
        return
    loaded = load_model(args.model, dtype=args.dtype)
    prompts = load_prompts(loaded, args.docs)
    n = args.new_tokens
    burst = [0.0] * len(prompts)
    stream = arrivals(len(prompts), args.rate)
    plan: list[tuple[str, str, Callable[[], Run]]] = []
    for scenario, at in (("burst", burst), ("stream", stream)):
        if scenario not in args.scenarios.split(","):
            continue
        if "hf_generate_1" in variants:
            plan.append(("hf_generate_1", scenario, lambda at=at: hf_generate(loaded, prompts, n, at, 1)))
        if "hf_generate_static4" in variants and scenario == "burst":
            plan.append(
                ("hf_generate_static4", scenario, lambda at=at: hf_generate(loaded, prompts, n, at, 4))
            )
        if "hf_generate_batch" in variants and scenario == "burst":
            plan.append(("hf_generate_batch", scenario, lambda: hf_generate_batch(loaded, prompts, n)))
        engines = (("engine_static", False, True), ("engine_dynamic", True, True),
                   ("engine_dynamic_noprefix", True, False))  # fmt: skip
        for name, dynamic, prefix in engines:
            if name in variants:
                plan.append((name, scenario, lambda at=at, d=dynamic, p=prefix: engine_run(
                    loaded, prompts, n, at, d, args.max_batch, args.step_tokens, p)))  # fmt: skip
    runs = []
    for name, scenario, fn in plan:
        console.print(f"running {name} / {scenario} ...")
        with PeakRSS() as rss:
            run = fn()
        run.variant, run.scenario, run.peak_rss_mib = name, scenario, rss.mib
        runs.append(run)
        console.print(f"  {run.row()['tok_s']:.1f} tok/s in {run.wall_s:.1f} s")
    isolation = (
        [ttft_isolation(loaded, args.max_batch, args.step_tokens, p) for p in (True, False)]
        if isolating
        else []
    )
    report(args, runs, isolation, console)


def report(args: Any, runs: list[Run], isolation: list[dict[str, Any]], console: Console) -> None:
    """The table, the ratios and the JSON (a child process writes the JSON only)."""
    if args.part:
        args.out.write_text(
            json.dumps({"runs": [asdict(r) for r in runs], "ttft_isolation": isolation}, default=str)
        )
        return
    n = args.new_tokens
    table = Table("variant", "scenario", "tok/s", "req/s", "p50 s", "p95 s", "TTFT p50", "TTFT p95", "peak RSS MiB", "KV MiB",
                  title=f"{args.docs} documents x {n} tokens, {args.dtype}, {torch.get_num_threads()} threads")  # fmt: skip
    for run in runs:
        r = run.row()
        table.add_row(r["variant"], r["scenario"], f"{r['tok_s']:.1f}", f"{r['req_s']:.3f}", f"{r['p50_s']:.1f}",
                      f"{r['p95_s']:.1f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p95_s']:.2f}", f"{r['peak_rss_mib']:.0f}",
                      "-" if r["kv_mib"] is None else f"{r['kv_mib']:.0f}")  # fmt: skip
    console.print(table)
    base = {r.scenario: r for r in runs if r.variant == "hf_generate_1"}
    peer = next((r for r in runs if r.variant == "hf_generate_batch"), None)
    ratios = {}
    for run in runs:
        if run.variant == "engine_dynamic":
            tok = run.tokens / run.wall_s
            if run.scenario in base:
                ratios[f"{run.scenario}: engine_dynamic / hf_generate_1 tok/s"] = tok / (
                    base[run.scenario].tokens / base[run.scenario].wall_s
                )
            if peer is not None and run.scenario == "burst":
                ratios["burst: engine_dynamic / hf_generate_batch tok/s"] = tok / (peer.tokens / peer.wall_s)
            plain = next(
                (r for r in runs if r.variant == "engine_dynamic_noprefix" and r.scenario == run.scenario),
                None,
            )
            if plain is not None:
                ratios[f"{run.scenario}: engine_dynamic / engine_dynamic_noprefix tok/s"] = tok / (
                    plain.tokens / plain.wall_s
                )
    for key, value in ratios.items():
        console.print(f"{key}: {value:.2f}x")
    for iso in isolation:
        console.print(f"TTFT isolation, prefix caching {'on' if iso['prefix_caching'] else 'off'}: short request "
                      f"({iso['short_prompt_tokens']} tokens) p95 alone {iso['solo_p95_s']:.2f} s, during long "
                      f"prefills {iso['busy_p95_s']:.2f} s ({iso['ratio']:.2f}x)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "runs": [asdict(r) | {"summary": r.row()} for r in runs], "ratios": ratios, "ttft_isolation": isolation,
    }, indent=2, default=str))  # fmt: skip
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
