"""Where a burst's steps spend their time, without a profiler: the peers workload (the first
`--docs` corpus prompts, `--new-tokens` each with EOS ignored, all at t=0, our engine with its
defaults but for `--kv-kernel`, `--kv-profile` and `--decode-defer`) run once unmeasured and once timed, every engine step classed as a
prompt step (it carries prompt chunks) or a decode step, and within those steps the wall time of
the model's parts summed: the weights' products (`PackedLinear`), the native attention kernels
(prompt chunks, decodes), the MLP and attention modules (products included), RMSNorm, rotary
embedding, sampling. Timers wrap the modules' `forward` (and the kernels' methods) in this
process only; a wrapped call costs ~1 us against the 0.05-5 ms calls it times. `torch.profiler`
(`bench.engine_profile`) sees operators, not where the engine's own kernels go, and slows small
operators; this sees the engine's parts at their own speed.

    python -m bench.engine_steps --out bench/results/engine-steps-cpu-amx.json
    python -m bench.engine_steps --decode-defer 16 --out bench/results/engine-steps-deferred-cpu-amx.json
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from bench.engine_variants import WARM_UP_IDS, engine_run, load_prompts
from engine.config import KVKernel
from engine.kv_cache import KVCache
from engine.kv_native import NativeKernel
from engine.loader import load_model
from engine.runner import ModelRunner


class StepTimers:
    """Seconds per part, per kind of step, while `active`."""

    def __init__(self) -> None:
        self.kind: str | None = None  # "prompt" or "decode" while a step runs
        self.seconds: dict[str, dict[str, float]] = {
            "prompt": defaultdict(float),
            "decode": defaultdict(float),
        }
        self.steps: dict[str, int] = {"prompt": 0, "decode": 0}
        self.active = False

    def reset(self) -> None:
        for kind in self.seconds.values():
            kind.clear()
        self.steps = dict.fromkeys(self.steps, 0)

    def total(self, part: str) -> float:
        """Seconds in `part` over both kinds of step."""
        return sum(kind.get(part, 0.0) for kind in self.seconds.values())

    def wrap(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.kind is None:
                return call(*args, **kwargs)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[self.kind][part] += time.perf_counter() - start

        return timed

    def step(self, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(runner: ModelRunner, plan: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return call(runner, plan, *args, **kwargs)
            self.kind = "decode" if all(c.num_tokens == 1 for c in plan) else "prompt"
            self.steps[self.kind] += 1
            start = time.perf_counter()
            try:
                return call(runner, plan, *args, **kwargs)
            finally:
                self.seconds[self.kind]["whole step"] += time.perf_counter() - start
                self.kind = None

        return timed


def instrument(model: torch.nn.Module, timers: StepTimers) -> list[Callable[[], None]]:
    """Wraps the parts' `forward` on this model's modules (instances, not classes) and the runner's
    and kernel's methods (classes: restored by the returned undo calls)."""
    undo: list[Callable[[], None]] = []
    names = {"PackedLinear": "weights' products", "NativeMLP": "MLP module", "Qwen2MLP": "MLP module",
             "LlamaMLP": "MLP module", "NativeRMSNorm": "RMSNorm", "Qwen2RMSNorm": "RMSNorm",
             "LlamaRMSNorm": "RMSNorm", "Qwen2Attention": "attention module", "LlamaAttention": "attention module",
             "NativeAttention": "attention module",
             "Qwen2RotaryEmbedding": "rotary embedding", "LlamaRotaryEmbedding": "rotary embedding"}  # fmt: skip
    for module in model.modules():
        if (part := names.get(type(module).__name__)) is not None:
            module.forward = timers.wrap(part, module.forward)  # type: ignore[method-assign]
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:  # the output head: a product of its own, outside the layers
        lm_head.forward = timers.wrap("output head", lm_head.forward)
    patches = [(ModelRunner, "step", timers.step(ModelRunner.step)),
               (ModelRunner, "_sample", timers.wrap("sampling", ModelRunner._sample)),
               (NativeKernel, "prefill_attention", timers.wrap("prompt attention (kernel)", NativeKernel.prefill_attention)),
               (NativeKernel, "decode_attention", timers.wrap("decode attention (kernel)", NativeKernel.decode_attention)),
               (KVCache, "settle", timers.wrap("blocks quantised (settle)", KVCache.settle)),
               (KVCache, "locate", timers.wrap("history located", KVCache.locate))]  # fmt: skip
    for owner, name, patched in patches:
        original = getattr(owner, name)
        setattr(owner, name, patched)
        undo.append(functools.partial(setattr, owner, name, original))
    return undo


def main() -> None:
    from bench.kv_cost import PROFILES  # which imports these timers

    parser = common.parser(__doc__)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=192)
    parser.add_argument("--kv-kernel", default="auto")
    parser.add_argument("--decode-defer", type=int, default=0, help="the engine's DECODE_DEFER_STEPS")
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        help="the engine's SPECULATIVE_TOKENS (unset: its default)",
    )
    parser.add_argument(
        "--speculative-step-tokens",
        type=int,
        default=None,
        help="the engine's SPECULATIVE_STEP_TOKENS (0: the step's budget; unset: its default)",
    )
    parser.add_argument(
        "--kv-profile", default="off", choices=list(PROFILES),
        help="KV compression as bench.kv_cost names it (its reader replaces --kv-kernel unless off)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine-steps.json"))
    args = parser.parse_args()
    kv_bits, kv_reader, int8_layers, int6_layers, int6_parts, prompt_tokens = PROFILES[args.kv_profile]
    console = Console(width=160)
    loaded = load_model(common.model_path(args.model), dtype="bfloat16")
    prompts = load_prompts(loaded.tokenizer, args.docs)
    timers = StepTimers()
    undo = instrument(loaded.model, timers)
    kernel: KVKernel = args.kv_kernel if args.kv_profile == "off" else kv_reader
    try:
        engine_run(loaded, [WARM_UP_IDS], 8, [0.0], True, args.max_batch, args.step_tokens, True, 1 << 30)
        timers.active = True
        run = engine_run(loaded, prompts, args.new_tokens, [0.0] * len(prompts), True, args.max_batch,
                         args.step_tokens, True, 1 << 30, kv_bits=kv_bits, kv_kernel=kernel,
                         kv_int8_layers=int8_layers, kv_int6_layers=int6_layers, kv_int6_parts=int6_parts,
                         kv_prompt_tokens=prompt_tokens, decode_defer_steps=args.decode_defer,
                         speculative_tokens=args.speculative_tokens,
                         speculative_step_tokens=args.speculative_step_tokens)  # fmt: skip
    finally:
        for call in undo:
            call()
    table = Table("part", *(f"{kind} steps ({timers.steps[kind]}), ms a step" for kind in timers.steps), "share of all steps",
                  title=f"burst of {args.docs} x {args.new_tokens} tokens: {run.wall_s:.1f} s, "
                        f"{run.tokens / run.wall_s:.1f} tokens/s")  # fmt: skip
    whole = sum(timers.seconds[kind]["whole step"] for kind in timers.steps)
    parts = sorted({p for kind in timers.seconds.values() for p in kind}, key=lambda p: -sum(
        timers.seconds[k].get(p, 0.0) for k in timers.steps))  # fmt: skip
    for part in parts:
        per_step = [timers.seconds[k].get(part, 0.0) / max(1, timers.steps[k]) * 1e3 for k in timers.steps]
        share = sum(timers.seconds[k].get(part, 0.0) for k in timers.steps) / whole
        table.add_row(part, *(f"{ms:.1f}" for ms in per_step), f"{share:.0%}")
    console.print(table)
    console.print(
        "(modules include what they call: the MLP and attention modules their products and kernels)"
    )
    console.print(
        f"draft tokens {run.extra['draft_tokens']}, of which accepted {run.extra['accepted_drafts']}"
    )
    common.write_result(args.out, args, console, wall_s=run.wall_s, tokens=run.tokens, steps=timers.steps,
                        drafts={"proposed": run.extra["draft_tokens"], "accepted": run.extra["accepted_drafts"]},
                        seconds={k: dict(v) for k, v in timers.seconds.items()})  # fmt: skip


if __name__ == "__main__":
    main()
