"""Whether to fuse the gated MLP's element-wise work into its packed products: measured, not built.

vLLM's CPU path runs SiLU-and-multiply as one fused kernel; oneDNN can do it as post-ops of the
packed products the engine already runs (`engine.linear.PackedLinear`): SiLU as a post-op of the
gate's product (`swish`) and the product with the gate as a post-op of the up projection's
(binary `mul`), where transformers' MLP makes two passes of its own over the intermediate width.
`FusedMLP` does that; `SeparateMLP` is transformers' MLP over the same packed weights (what the
engine runs). Both are timed over `--layers` layers of distinct random weights of the model's shape
(so each product reads its weights from memory, as an engine step does) at each of `--rows` rows,
alternating within each of `--rounds` rounds; per variant and row count the median round, in ms
per layer. Random weights: a product's speed does not depend on its values. On the 2-core AMX
machine the difference stayed within its noise (README, issue 22), so the engine keeps
transformers' MLP; the engine-level A/B ran as `bench.engine_bench`'s `engine_dynamic_unfused`
in commit ed1e181, where the fusion was the engine's.

    python -m bench.mlp_fusion --rows 8,32,192 --rounds 7 --out bench/results/mlp-fusion-cpu.json
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from engine.linear import PackedLinear, can_pack

VARIANTS = ("separate", "fused")


class SeparateMLP(torch.nn.Module):
    """transformers' gated SiLU MLP, `down(silu(gate(x)) * up(x))`, over packed projections."""

    def __init__(self, gate_proj: PackedLinear, up_proj: PackedLinear, down_proj: PackedLinear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class FusedMLP(SeparateMLP):
    """The same MLP with SiLU and the product with the gate as oneDNN post-ops of the gate's and the
    up projection's products: no pass of their own over the intermediate width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        activated = torch.ops.mkldnn._linear_pointwise(x, gate.packed, gate.bias, "swish", [], "")
        hidden = torch.ops.mkldnn._linear_pointwise.binary(x, activated, up.packed, up.bias, "mul")
        out: torch.Tensor = self.down_proj(hidden)
        return out


def build_layers(hidden: int, intermediate: int, layers: int, dtype: torch.dtype) -> list[FusedMLP]:
    """`layers` fused MLPs of random weights (scaled as an initialised model's) in `dtype`."""

    def packed(out_features: int, in_features: int) -> PackedLinear:
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        torch.nn.init.normal_(linear.weight, std=in_features**-0.5)
        return PackedLinear(linear.to(dtype))

    return [
        FusedMLP(packed(intermediate, hidden), packed(intermediate, hidden), packed(hidden, intermediate))
        for _ in range(layers)
    ]


def time_rows(mlps: list[FusedMLP], rows: int, rounds: int, dtype: torch.dtype) -> dict[str, list[float]]:
    """ms per layer of one pass through `mlps` at `rows` rows, each variant in each round."""
    separate = [SeparateMLP(m.gate_proj, m.up_proj, m.down_proj) for m in mlps]
    variants: dict[str, list[SeparateMLP]] = {"separate": separate, "fused": list(mlps)}
    x = torch.randn(1, rows, mlps[0].gate_proj.in_features, dtype=dtype)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with torch.inference_mode():
        for modules in variants.values():  # warm-up: oneDNN plans each shape once
            modules[0](x)
        for _ in range(rounds):
            for name, modules in variants.items():
                start = time.perf_counter()
                for module in modules:
                    module(x)
                times[name].append((time.perf_counter() - start) / len(modules) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--hidden", type=int, default=896, help="the model's width (0.5B default)")
    parser.add_argument("--intermediate", type=int, default=4864, help="the MLP's width (0.5B default)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", default="8,32,192", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/mlp-fusion.json"))
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not can_pack(torch.device("cpu"), dtype):
        parser.error(f"this CPU's oneDNN does not pack {args.dtype}: the engine runs plain MLPs here")
    mlps = build_layers(args.hidden, args.intermediate, args.layers, dtype)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        times = time_rows(mlps, rows, args.rounds, dtype)
        median = {name: statistics.median(values) for name, values in times.items()}
        results.append({"rows": rows, "ms_per_layer": median, "rounds": times,
                        "fused_over_separate": median["fused"] / median["separate"]})  # fmt: skip
    table = Table("rows", "separate ms/layer", "fused ms/layer", "fused / separate",
                  title=f"gated MLP, {args.hidden}x{args.intermediate}, {args.layers} layers, {args.dtype}")  # fmt: skip
    for r in results:
        ms = r["ms_per_layer"]
        table.add_row(
            str(r["rows"]), f"{ms['separate']:.3f}", f"{ms['fused']:.3f}", f"{r['fused_over_separate']:.3f}"
        )
    Console(width=120).print(table)
    payload: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "config": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
