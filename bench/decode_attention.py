"""How fast decode attention reads full-precision history: torch's path, which gathers each
sequence's keys and values out of the paged pool into a padded copy before its batched products
(`attention.decode_attention`), against the native kernel reading them where they lie
(`attention.in_place_attention`), built for each path this CPU runs (its own, `-march=native`,
with its AMX tiles where it has them (bf16 full-precision history) and without (KV_KERNEL=avx512);
AVX2's and the portable one, what older CPUs build), in one run.

The cache has the default model's attention shape (14 query heads over 2 KV heads of 64
channels, 16-token blocks) and `--layers` layers of random keys and values; `--seqs` sequences
of `--history` tokens on average (+-20 %, so that torch groups them by length as in a step), their
blocks scattered over the pool; full precision, or (`--bits` 8, 4) quantised as KV_COMPRESSION
keeps them once they leave the window, but for 16-31 recent tokens. Torch's path dequantises
quantised blocks into a copy first (with the C reader, as the engine does on a CPU). A timed call is one step's decode attention: every layer once.
`--drafts N` lays each sequence out as a decode and N draft rows over one history, as a step of
guesses does; `--against REV` adds this CPU's kernel built from the engine's C files at git
revision REV, to compare a change with what came before it in the same run.
Readers run in rotated order every round; the median round's time is reported, with the speed
against torch's (torch's time over the reader's) taken within each round. Each reader's output
is checked against torch's before it is timed.

    python -m bench.decode_attention --out bench/results/decode-attention-cpu.json
    python -m bench.decode_attention --bits 16 --history 480 --drafts 1 --against 97dcf64 \
        --out bench/results/decode-attention-cpu-epyc-drafts1.json
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from engine import kv_native
from engine.attention import SeqSlice, decode_attention, group_decodes, in_place_attention, in_place_decodes
from engine.kv_cache import ColdStore, KVCache, KVShape, slots_of
from engine.kv_native import NativeKernel
from engine.kv_quant import QuantFormat

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16


def builds(against: tuple[str, ...] = ()) -> dict[str, NativeKernel]:
    """Name -> the kernel built for each path this CPU runs (its own with AMX tiles, where it has
    them, and without: KV_KERNEL=avx512), and this CPU's own built from each revision `against`."""
    found: dict[str, NativeKernel] = {}
    for revision in against:
        earlier = common.kernel_at(revision)
        if earlier is None:
            raise SystemExit(f"the native kernel at {revision} did not build")
        found[f"in place, this CPU's at {revision}"] = earlier
    for choice, kernel in common.kernel_builds().items():
        if choice == "auto" and kernel.tiles:
            found[f"in place, this CPU's without tiles ({kernel.attention_isa})"] = replace(
                kernel, tiles=False
            )
        name = (
            f"this CPU's ({kernel.decode_isa(torch.bfloat16, HEAD_DIM)} in bf16)"
            if choice == "auto"
            else choice
        )
        found[f"in place, {name}"] = kernel
    return found


def paged(
    dtype: torch.dtype, layers: int, seqs: int, history: int, bits: int, drafts: int = 0
) -> tuple[KVCache, list[SeqSlice]]:
    """Sequences of ~`history` tokens: all full precision (`bits` 16), or all in quantised blocks
    of `bits` but for their last 16 tokens, as with KV_COMPRESSION after the window moved on.
    With `drafts`, each sequence is a decode and that many draft tokens, rows side by side over
    one history, each a token longer (as the engine lays out a step of guesses)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(int(history * 0.8), int(history * 1.2) + 1, (seqs,), generator=gen).tolist()
    shape = KVShape(layers, KV_HEADS, HEAD_DIM, dtype)
    quantised = [n // BLOCK - 1 if bits < 16 else 0 for n in lengths]  # whole blocks; 16-31 tokens stay
    hot = [n - BLOCK * q for n, q in zip(lengths, quantised, strict=True)]
    tables = [-(-n // BLOCK) for n in hot]
    order = torch.randperm(sum(tables), generator=gen).tolist()
    store = None
    if bits < 16:
        reader = kv_native.load()  # torch's path reads quantised blocks with it, as the engine does
        store = ColdStore(shape, QuantFormat(bits), sum(quantised), BLOCK, torch.device("cpu"), reader)
        for start in range(0, sum(quantised), 64):
            ids = torch.arange(start, min(start + 64, sum(quantised)))
            kv = torch.randn(2, layers, len(ids), BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            store.store(kv[0], kv[1], ids)
    cold_order = torch.randperm(sum(quantised), generator=gen)
    cache = KVCache(shape, len(order), BLOCK, torch.device("cpu"), store)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    slices, used, used_cold = [], 0, 0
    for n, blocks, q in zip(hot, tables, quantised, strict=True):
        cold = cold_order[used_cold : used_cold + q] if q else None
        slots = slots_of(order[used : used + blocks], n, BLOCK)
        for d in range(drafts + 1):
            held = slots[: n - drafts + d]
            slices.append(SeqSlice(len(slices), 1, held, cold, q * BLOCK))
        used, used_cold = used + blocks, used_cold + q
    return cache, slices


def readers(
    cache: KVCache, seqs: list[SeqSlice], against: tuple[str, ...] = ()
) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Name -> one layer's decode attention (query (H, B, D), layer) -> (B, H, D)."""
    groups = group_decodes(seqs, KV_HEADS, BLOCK, torch.device("cpu"))
    decodes, _ = in_place_decodes(seqs, cold=cache.cold is not None)
    if decodes is None:
        raise ValueError("no sequences to attend")

    def gathered(query: torch.Tensor, layer: int) -> torch.Tensor:
        out = torch.empty(query.shape[1], HEADS, HEAD_DIM, dtype=query.dtype)
        for group in groups:
            out[group.rows] = decode_attention(query, cache, layer, group, HEAD_DIM**-0.5)
        return out

    def in_place(kernel: NativeKernel) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def read(query: torch.Tensor, layer: int) -> torch.Tensor:
            cache.kernel = kernel
            return in_place_attention(query, cache, layer, decodes, HEAD_DIM**-0.5)

        return read

    return {"gathered (torch)": gathered} | {name: in_place(k) for name, k in builds(against).items()}


def one_step(read: Callable[[torch.Tensor, int], torch.Tensor], query: torch.Tensor, layers: int) -> None:
    for layer in range(layers):
        read(query, layer)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--seqs", type=int, default=32, help="sequences decoding at once")
    parser.add_argument("--history", type=int, default=1024, help="tokens per sequence, on average")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per reader and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bits", default="16,8,4", help="16: full-precision history; 8, 4: quantised")
    parser.add_argument("--drafts", type=int, default=0, help="draft rows beside each sequence's decode")
    parser.add_argument(
        "--against",
        default="",
        help="git revisions whose kernel (this CPU's build) runs beside, comma-separated",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode-attention.json"))
    args = parser.parse_args()
    console = Console(width=160)
    table = Table("dtype", "history", "reader", "ms per step (median)", "GB/s (every row's history at full precision)", "speed vs torch (median)",
                  title=f"decode attention, {args.seqs} sequences x ~{args.history} tokens, {args.drafts} drafts each, {args.layers} "
                        f"layers, {args.rounds} rounds")  # fmt: skip
    cases: list[dict[str, Any]] = []
    against = tuple(r for r in args.against.split(",") if r)
    for dtype_name, dtype, bits in [(n, d, int(b)) for n, d in DTYPES.items() for b in args.bits.split(",")]:
        cache, seqs = paged(dtype, args.layers, args.seqs, args.history, bits, args.drafts)
        query = torch.randn(HEADS, len(seqs), HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
        reads = readers(cache, seqs, against)
        with torch.inference_mode():
            reference = reads["gathered (torch)"](query, 0).float()
            step = 2**-6 if dtype == torch.bfloat16 else 1e-5
            for name, read in reads.items():  # checked, and warmed
                torch.testing.assert_close(read(query, 0).float(), reference, rtol=step, atol=step, msg=name)
            names = list(reads)
            steps = {
                name: functools.partial(one_step, read, query, args.layers) for name, read in reads.items()
            }
            times = common.rotated_rounds(steps, args.rounds, repeats=args.steps)
        tokens = sum(s.kv_len for s in seqs)  # bytes of history as full precision would hold it
        history_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * args.layers * dtype.itemsize
        for name in names:
            speed = common.against(times, name, "gathered (torch)")
            median = speed["s_median"]
            case = {"dtype": dtype_name, "bits": bits, "reader": name, "s_per_step": times[name], "s_median": median,
                    "speed_vs_torch": speed["speed_vs_baseline"],
                    "speed_vs_torch_median": speed["speed_vs_baseline_median"]}  # fmt: skip
            cases.append(case)
            table.add_row(dtype_name, "full precision" if bits == 16 else f"int{bits}", name, f"{median * 1e3:.1f}", f"{history_bytes / median / 1e9:.1f}",
                          f"{case['speed_vs_torch_median']:.2f}x")  # fmt: skip
    console.print(table)
    common.write_result(args.out, args, console, threads=torch.get_num_threads(), cases=cases)


if __name__ == "__main__":
    main()
