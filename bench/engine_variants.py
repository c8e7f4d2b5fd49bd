"""The ways the engine benchmark serves its prompts, each timed on its own: `model.generate` one
request at a time or in static batches, transformers' `generate_batch`, and our engine (the table
`ENGINE_VARIANTS`), plus the TTFT-isolation measurement. `bench.engine_bench` plans, repeats and
reports them."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import common
from engine import Engine, EngineConfig, SamplingParams
from engine.config import KVKernel, PromptAttention
from engine.loader import LoadedModel
from prompts import render
from schemas import BUILT_IN_KINDS, DocumentKind, Language

CORPUS = Path(__file__).with_name("data") / "corpus.jsonl"
# a warm-up request's ids: no workload prompt starts so, so it leaves nothing of the workload cached
WARM_UP_IDS = list(range(1000, 1032))


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
    round: int = 0  # which repetition of the headline runs (0: the first, where every variant runs)

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
    """Samples resident memory while a variant runs (ru_maxrss is process-wide): this process's,
    or with `pid`, that process's and its children's together (a server and its workers)."""

    def __init__(self, pid: int | None = None) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._tree = pid is not None
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for process in [self._root, *(self._root.children(recursive=True) if self._tree else [])]:
                with suppress(psutil.NoSuchProcess):  # a child may exit between listing and reading
                    total += process.memory_info().rss
            self.peak = max(self.peak, total)
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


def load_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The first `count` corpus documents of a fixed shuffle, as the service's prompts (token ids)."""
    docs = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(7)
    rng.shuffle(docs)  # a deterministic mix of kinds, languages and lengths
    return [prompt_ids(tokenizer, doc) for doc in docs[:count]]


def prompt_ids(tokenizer: Any, doc: dict[str, Any]) -> list[int]:
    """A corpus document's prompt as the service renders it, as token ids."""
    prompt = render(BUILT_IN_KINDS[DocumentKind(doc["kind"])], Language(doc["language"]), doc["text"])
    ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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


def _sync(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


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
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in group], device=loaded.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group], device=loaded.device)
        streamer = _FirstToken()
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=pad, streamer=streamer,
        )  # fmt: skip
        _sync(loaded)
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
    # an engine that ran on this model before left its own attention function, which generate_batch
    # refuses (seen on the GPU run of 2026-12-04 when no hf_generate run came between)
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    _sync(loaded)
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
    kv_cache_bytes: int = 1 << 30,
    kv_bits: int = 16,
    kv_kernel: KVKernel = "auto",
    kv_int8_layers: tuple[int, ...] = (),
    decode_defer_steps: int = 0,
    prompt_attention: PromptAttention = "auto",
    saturated_tokens_per_step: int | None = None,
    speculative_tokens: int | None = None,
    speculative_step_tokens: int | None = None,
    kv_int6_layers: tuple[int, ...] = (),
    kv_int6_parts: tuple[str, ...] = (),
    kv_prompt_tokens: int = 0,
) -> Run:
    async def go() -> Run:
        drafts = common.given(
            speculative_tokens=speculative_tokens, speculative_step_tokens=speculative_step_tokens
        )
        config = EngineConfig(
            model_path=Path("bench"), dynamic_batching=dynamic, max_batch_size=max_batch,
            kv_cache_bytes=kv_cache_bytes, max_tokens_per_step=budget, prefix_caching=prefix_caching,
            kv_compression=kv_bits < 16, kv_quant_bits=kv_bits, kv_kernel=kv_kernel,
            kv_int8_layers=kv_int8_layers, kv_int6_layers=kv_int6_layers,
            kv_int6_parts=kv_int6_parts, kv_prompt_tokens=kv_prompt_tokens, decode_defer_steps=decode_defer_steps,
            prompt_attention=prompt_attention, saturated_tokens_per_step=saturated_tokens_per_step, **drafts,
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
             "prefix_hit_tokens": stats.prefix_hit_tokens, "prompt_tokens": sum(map(len, prompts)),
             "preemptions": stats.num_preemptions, "kv_bytes_per_token": stats.kv_bytes_per_token,
             "kv_quantised_bytes_ratio": stats.kv_cold_bytes_per_token / stats.kv_bytes_per_token
             if stats.kv_quant_bits else None, "kv_reader": stats.kv_reader,
             "prompt_reader": stats.prompt_reader, "draft_tokens": stats.num_draft_tokens,
             "accepted_drafts": stats.num_accepted_drafts},
        )  # fmt: skip

    return asyncio.run(go())


def ttft_isolation(
    loaded: LoadedModel,
    max_batch: int,
    budget: int,
    prefix_caching: bool,
    reps: int = 10,
    kv_cache_bytes: int = 1 << 30,
    saturated_tokens_per_step: int | None = None,
) -> dict[str, Any]:
    """A short request's TTFT alone, then arriving while long prompts are being prefilled.

    One unmeasured solo run first, so that with prefix caching both measurements see the same
    warm cache (the short request's instruction prefix already computed). Every repetition's
    long prompts are documents not seen before (a cached prompt would not be prefilling), and
    the short request arrives at a random point of the long prefills (seeded), so the p95
    covers arrivals at any phase of a step."""
    prompts = sorted(load_prompts(loaded.tokenizer, 60), key=len)
    short, longs = prompts[0], prompts[-4 * reps :]
    rng = random.Random(3)

    async def go() -> dict[str, Any]:
        config = EngineConfig(
            model_path=Path("bench"), dynamic_batching=True, max_batch_size=max_batch,
            kv_cache_bytes=kv_cache_bytes, max_tokens_per_step=budget, prefix_caching=prefix_caching,
            saturated_tokens_per_step=saturated_tokens_per_step,
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
            "prefix_caching": prefix_caching, "step_tokens": budget,
            "saturated_step_tokens": saturated_tokens_per_step, "short_prompt_tokens": len(short),
            "long_prompt_tokens": [len(p) for p in longs], "arrival_offsets_s": offsets,
            "solo_ttft_s": solo, "busy_ttft_s": busy,
            "solo_p95_s": _pct(solo, 95), "busy_p95_s": _pct(busy, 95), "ratio": _pct(busy, 95) / _pct(solo, 95),
        }  # fmt: skip

    return asyncio.run(go())


# Our engine's variants: (DYNAMIC_BATCHING, prefix caching, KV bits; 16 = uncompressed).
ENGINE_VARIANTS = {"engine_static": (False, True, 16), "engine_dynamic": (True, True, 16),
                   "engine_dynamic_noprefix": (True, False, 16), "engine_dynamic_int8": (True, True, 8),
                   "engine_dynamic_int4": (True, True, 4), "engine_dynamic_unpacked": (True, True, 16),
                   "engine_dynamic_unfused": (True, True, 16), "engine_dynamic_deferred": (True, True, 16),
                   "engine_dynamic_sdpa": (True, True, 16)}  # fmt: skip
# Variants whose model keeps `nn.Linear` (PREPACK_WEIGHTS=false): what prepacking is worth.
UNPACKED_VARIANTS = frozenset({"engine_dynamic_unpacked"})
# Variants whose model keeps transformers' RMSNorm and MLP (FUSE_LAYERS=false): what fusing is worth.
UNFUSED_VARIANTS = frozenset({"engine_dynamic_unfused"})
# Variants whose decodes give way to waiting prompts for up to DEFERRED_STEPS steps in a row
# (DECODE_DEFER_STEPS): a burst's prompts read before its decodes, as vLLM's large steps do.
DEFERRED_VARIANTS = frozenset({"engine_dynamic_deferred"})
DEFERRED_STEPS = 16
# Variants whose prompt chunks are attended by torch's SDPA over a gathered copy
# (PROMPT_ATTENTION=torch): what the native kernel's in-place prompt attention is worth.
SDPA_VARIANTS = frozenset({"engine_dynamic_sdpa"})
