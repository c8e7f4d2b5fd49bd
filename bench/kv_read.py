"""How fast each reader of quantised KV blocks reads them: torch, and the C kernel built for each
path this CPU runs (its own, `-march=native`; AVX2, what a CPU without AVX-512 builds; the
portable loop, a CPU with neither), in one run.

A read is what decode attention asks of the store once per layer and step (`ColdStore.gathered`):
the (block, KV head) rows of a batch of sequences, gathered and dequantised into the cache's
dtype. The store has the default model's KV shape (2 KV heads of 64 channels, 16-token blocks),
random codes, scales and offsets; `--seqs` sequences of `--history` quantised tokens each are read
in a shuffled block order. Every reader reads the same rows in every round, readers in rotated
order; the median round's time per read is reported, with the speed against torch's (torch's
time over the reader's) taken within each round.
Each kernel's output is checked against torch's, and every reader warmed, before it is timed.

    python -m bench.kv_read --out bench/results/kv-read-cpu.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from engine.kv_cache import ColdStore, KVShape, head_major_rows
from engine.kv_native import NativeKernel
from engine.kv_quant import QuantFormat

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def readers() -> dict[str, NativeKernel | None]:
    """Reader name -> kernel (None: torch), for every path this CPU can run."""
    found: dict[str, NativeKernel | None] = {"torch": None}
    for choice, kernel in common.kernel_builds().items():
        found[f"native-{kernel.isa}" + (" (this CPU's)" if choice == "auto" else "")] = kernel
    return found


def filled_store(shape: KVShape, fmt: QuantFormat, blocks: int, kernel: NativeKernel | None) -> ColdStore:
    store = ColdStore(shape, fmt, blocks, 16, torch.device("cpu"), kernel)
    gen = torch.Generator().manual_seed(0)
    for group in store.groups:
        for t in group.tensors:
            if t.dtype.is_floating_point:
                t.copy_(torch.rand(t.shape, generator=gen) * 0.1)
            else:
                t.copy_(torch.randint(-128, 128, t.shape, generator=gen, dtype=torch.int16).to(t.dtype))
    return store


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--seqs", type=int, default=16, help="sequences read at once (a decode batch)")
    parser.add_argument("--history", type=int, default=1024, help="quantised tokens per sequence")
    parser.add_argument("--reads", type=int, default=50, help="reads timed per reader and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-read.json"))
    args = parser.parse_args()
    kernels = readers()
    per_seq = args.history // 16
    heads, blocks = 2, args.seqs * per_seq
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    rows = head_major_rows(order.view(args.seqs, per_seq), heads)  # (sequence, KV head, block)
    pairs = args.seqs * heads
    console = Console(width=160)
    table = Table("dtype", "bits", "reader", "ms per read (median)", "GB/s out", "speed vs torch (median)",
                  title=f"{args.seqs} sequences x {args.history} quantised tokens, one layer's read, "
                        f"{args.rounds} rounds")  # fmt: skip
    cases: list[dict[str, Any]] = []
    for dtype_name, dtype in DTYPES.items():
        shape = KVShape(1, heads, 64, dtype)
        for bits in (8, 4):
            stores = {name: filled_store(shape, QuantFormat(bits), blocks, k) for name, k in kernels.items()}
            reference = stores["torch"].gathered(0, rows, pairs)
            for name, store in stores.items():
                got = store.gathered(0, rows, pairs)
                for a, b in ((got.keys, reference.keys), (got.values, reference.values)):
                    torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6, msg=name)
            for store in stores.values():  # warm: first reads fault in fresh output pages
                for _ in range(args.reads):
                    store.gathered(0, rows, pairs)
            names = list(stores)
            reads = {name: (lambda store=store: [store.gathered(0, rows, pairs) for _ in range(args.reads)])
                     for name, store in stores.items()}  # fmt: skip
            times = common.rotated_rounds(reads, args.rounds, repeats=1)
            times = {name: [t / args.reads for t in ts] for name, ts in times.items()}
            out_bytes = 2 * rows.numel() * 16 * 64 * reference.keys.element_size()
            for name in names:
                speed = common.against(times, name, "torch")
                median = speed["s_median"]
                case = {"dtype": dtype_name, "bits": bits, "reader": name, "s_per_read": times[name],
                        "s_median": median, "speed_vs_torch": speed["speed_vs_baseline"],
                        "speed_vs_torch_median": speed["speed_vs_baseline_median"]}  # fmt: skip
                cases.append(case)
                table.add_row(dtype_name, str(bits), name, f"{median * 1e3:.3f}", f"{out_bytes / median / 1e9:.1f}",
                              f"{case['speed_vs_torch_median']:.2f}x")  # fmt: skip
    console.print(table)
    common.write_result(args.out, args, console, rows_per_read=rows.numel(), cases=cases)


if __name__ == "__main__":
    main()
