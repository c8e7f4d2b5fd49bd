"""How fast a decoder layer's element-wise work runs by the native kernels (`engine.fused`,
`layers_native.c`) against transformers' modules: RMSNorm over the default model's 896 channels,
SiLU(gate) * up over its 4,864-wide intermediate, and the rotary embedding of its 14 query and 2
key heads of 64 (transformers' `apply_rotary_pos_emb` on the q and k products against the kernel
turning them in place in the one q/k/v product), at the row counts of a decode step (1, 32)
and of prompt steps (192, 1,024), in bf16 and float32, for every build this CPU runs (its own,
AVX2's and the portable one). A timed run is `--layers` layers' worth of calls (two RMSNorms, one
SiLU * up and one rotary embedding a layer); runs rotate every round and the speed against torch
is taken within each round; the median round is reported. Each result is checked against torch's before it is timed.
`NativeKernel.fuses_mlp` (SiLU * up only on the AVX-512 build) rests on this table.

    python -m bench.fused_layers --out bench/results/fused-layers-cpu-amx.json
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from bench import common
from engine.fused import NativeRMSNorm
from engine.kv_native import NativeKernel

HIDDEN, INTERMEDIATE = 896, 4864
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
WIDTHS = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]  # q, k, v
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def repeat(call: Callable[[], object], times: int) -> None:
    for _ in range(times):
        call()


def turn_copy(
    kernel: NativeKernel, buffer: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """The kernel's rotary embedding of a fresh copy of `qkv` (the copy timed with it, as torch's
    operators write new tensors): turned again and again in place, bf16 values would shrink by
    rounding into subnormal numbers, which no step ever sees and which run ~100x slower."""
    buffer.copy_(qkv)
    kernel.rotary(buffer, cos, sin, HEADS + KV_HEADS, HEAD_DIM)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rows", default="1,32,192,1024")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fused-layers.json"))
    args = parser.parse_args()
    console = Console(width=160)
    builds = common.kernel_builds()
    gen = torch.Generator().manual_seed(0)
    table = Table("dtype", "rows", "work", "torch, ms", *(f"{b} ({k.layers_isa}), vs torch" for b, k in builds.items()),
                  title=f"element-wise work of {args.layers} layers, {args.rounds} rounds (median)")  # fmt: skip
    cases: list[dict[str, Any]] = []
    for dtype_name, dtype in DTYPES.items():
        norm = Qwen2RMSNorm(HIDDEN, eps=1e-6).to(dtype)
        norm.weight.data = torch.randn(HIDDEN, generator=gen).to(dtype)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(1, rows, HIDDEN, generator=gen).to(dtype)
            gate, up = (torch.randn(1, rows, INTERMEDIATE, generator=gen).to(dtype) for _ in range(2))
            # the rotary embedding's inputs from a generator of their own: the other work's are as before
            turns = torch.Generator().manual_seed(rows)
            qkv = torch.randn(1, rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=turns).to(dtype)
            q, k, _ = (part.contiguous() for part in qkv.split(WIDTHS, dim=-1))  # as three products give them
            angles = torch.rand(1, rows, HEAD_DIM, generator=turns) * 100
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            rope = functools.partial(
                apply_rotary_pos_emb, q.view(1, rows, HEADS, HEAD_DIM).transpose(1, 2),
                k.view(1, rows, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin,
            )  # fmt: skip
            work: dict[str, dict[str, Callable[[], object]]] = {
                "rmsnorm": {"torch": functools.partial(norm, x)},
                "silu * up": {"torch": lambda gate=gate, up=up: F.silu(gate) * up},
                "rope": {"torch": rope},
            }
            for name, kernel in builds.items():
                fused = NativeRMSNorm(norm, kernel)
                torch.testing.assert_close(fused(x), norm(x), rtol=2**-7, atol=2**-7)
                torch.testing.assert_close(
                    kernel.silu_mul(gate, up), F.silu(gate) * up, rtol=2**-7, atol=2**-7
                )
                turned = qkv.clone()
                kernel.rotary(turned, cos, sin, HEADS + KV_HEADS, HEAD_DIM)
                q_turned, k_turned = rope()
                expected = torch.cat(
                    (q_turned.transpose(1, 2).flatten(2), k_turned.transpose(1, 2).flatten(2)), -1
                )
                torch.testing.assert_close(turned[..., : WIDTHS[0] + WIDTHS[1]], expected)
                work["rmsnorm"][name] = functools.partial(fused, x)
                work["silu * up"][name] = functools.partial(kernel.silu_mul, gate, up)
                work["rope"][name] = functools.partial(
                    turn_copy, kernel, torch.empty_like(qkv), qkv, cos, sin
                )
            for what, calls in work.items():
                per_layer = 2 if what == "rmsnorm" else 1
                runs = {n: functools.partial(repeat, c, per_layer * args.layers) for n, c in calls.items()}
                with torch.inference_mode():
                    times = common.rotated_rounds(runs, args.rounds, repeats=1)
                speeds = {n: common.against(times, n, "torch") for n in builds}
                base = common.against(times, "torch", "torch")["s_median"]
                cases.append({"dtype": dtype_name, "rows": rows, "work": what, "torch_s": times["torch"],
                              "builds": {n: {"isa": builds[n].layers_isa, **s} for n, s in speeds.items()}})  # fmt: skip
                table.add_row(dtype_name, str(rows), what, f"{base * 1e3:.2f}",
                              *(f"{s['speed_vs_baseline_median']:.2f}x" for s in speeds.values()))  # fmt: skip
    console.print(table)
    common.write_result(args.out, args, console, threads=torch.get_num_threads(), cases=cases)


if __name__ == "__main__":
    main()
