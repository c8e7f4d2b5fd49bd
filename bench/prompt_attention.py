"""How fast prompt chunks attend to their sequence's history: torch's path, which gathers the
sequence's keys and values out of the paged pool (`KVCache.read`) and runs SDPA with a
bottom-right causal mask, against the native kernel reading the pool where the tokens lie
(`NativeKernel.prefill_attention`): by AVX-512 BF16 vectors, and by AMX tiles where the CPU has
them, in one run. Needs a CPU with AVX-512 BF16 (bf16).

The default model's attention shape (14 query heads over 2 KV heads of 64 channels, 16-token
blocks scattered over the pool), `--layers` layers; each case is a chunk of `q` new tokens after
`history` tokens already cached (the engine's 192-token prompt steps, a shared instruction prefix
of ~420 tokens, a 1,024-token step). A timed call is one chunk through every layer; the cases run
in rotated order every round, and the speed against torch (torch's time over the kernel's) is
taken within each round; the median round is reported. Each kernel result is checked against
torch's before it is timed.

    python -m bench.prompt_attention --out bench/results/prompt-attention-cpu-amx.json
    python -m bench.prompt_attention --out bench/results/prompt-attention-cpu-avx512.json
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from bench import common
from engine import kv_native
from engine.kv_cache import KVCache, KVShape, slots_of

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16
CASES = ((0, 192), (420, 192), (800, 192), (420, 96), (0, 1024))  # (history, chunk)
LABELS = {"vectors": "AVX-512 BF16 vectors", "tiles": "AMX tiles"}  # the in-place paths' columns


def torch_chunk(cache: KVCache, query: torch.Tensor, slots: torch.Tensor, layers: int) -> None:
    q_len, kv_len = query.shape[1], slots.shape[0]
    mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    for layer in range(layers):
        k, v = cache.read(layer, slots, None)
        F.scaled_dot_product_attention(
            query[None], k, v, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True
        )


def native_chunk(kernel: kv_native.NativeKernel, cache: KVCache, query: torch.Tensor, slots: torch.Tensor,
                layers: int) -> None:  # fmt: skip
    for layer in range(layers):
        kernel.prefill_attention(query, cache.keys[layer], cache.values[layer], slots, HEAD_DIM**-0.5)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="chunks timed per run and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/prompt-attention.json"))
    args = parser.parse_args()
    console = Console(width=160)
    kernel = kv_native.load()
    if kernel is None or kernel.prompt_isa(torch.bfloat16, HEAD_DIM) is None:
        raise SystemExit(
            "no AVX-512 BF16 build of the native kernel here: prompt chunks are attended by torch"
        )
    paths = {"vectors": replace(kernel, tiles=False), **({"tiles": kernel} if kernel.tiles else {})}
    gen = torch.Generator().manual_seed(0)
    runs, shapes = {}, {}
    for history, q_len in CASES:
        kv_len = history + q_len
        blocks = -(-kv_len // BLOCK)
        cache = KVCache(
            KVShape(args.layers, KV_HEADS, HEAD_DIM, torch.bfloat16), blocks + 8, BLOCK, torch.device("cpu")
        )
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
        cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
        slots = slots_of(torch.randperm(blocks + 8, generator=gen)[:blocks].tolist(), kv_len, BLOCK)
        packed = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        query = packed.transpose(0, 1)  # (H, q, D), tokens strided as the model hands them over
        mask = torch.arange(kv_len)[None, :] <= torch.arange(history, kv_len)[:, None]
        k, v = cache.read(0, slots, None)
        expected = F.scaled_dot_product_attention(query[None], k, v, attn_mask=mask, scale=HEAD_DIM**-0.5,
                                                  enable_gqa=True)[0].transpose(0, 1)  # fmt: skip
        name = f"{history}+{q_len}"
        shapes[name] = (history, q_len)
        runs[f"{name} torch"] = functools.partial(torch_chunk, cache, query, slots, args.layers)
        for path, native in paths.items():
            got = native.prefill_attention(query, cache.keys[0], cache.values[0], slots, HEAD_DIM**-0.5)
            torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
            runs[f"{name} {path}"] = functools.partial(native_chunk, native, cache, query, slots, args.layers)
    with torch.inference_mode():
        times = common.rotated_rounds(runs, args.rounds, repeats=args.repeats)
    columns = [f"{LABELS[path]} in place, ms | speed vs torch" for path in paths]
    table = Table("history + chunk", "torch: gather + SDPA, ms", *columns,
                  title=f"prompt-chunk attention, bf16, {args.layers} layers, {args.rounds} rounds")  # fmt: skip
    cases: list[dict[str, Any]] = []
    for name, (history, q_len) in shapes.items():
        torch_ms = common.against(times, f"{name} torch", f"{name} torch")["s_median"] * 1e3
        case: dict[str, Any] = {"history": history, "chunk": q_len, "torch_s": times[f"{name} torch"]}
        cells = []
        for path in paths:  # speed: torch's time over the path's, within each round, median round
            speed = common.against(times, f"{name} {path}", f"{name} torch")
            case[path] = {"s": times[f"{name} {path}"], **speed}
            cells.append(f"{speed['s_median'] * 1e3:.1f} | {speed['speed_vs_baseline_median']:.2f}x")
        cases.append(case)
        table.add_row(name, f"{torch_ms:.1f}", *cells)
    console.print(table)
    common.write_result(args.out, args, console, threads=torch.get_num_threads(), cases=cases)


if __name__ == "__main__":
    main()
