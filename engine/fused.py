"""A decoder layer's RMSNorm and its MLP's SiLU(gate) * up by the engine's C kernels, on a CPU.

transformers runs RMSNorm as seven operators (conversion, square, mean, rsqrt, two products,
conversion) and the MLP's activation as two (SiLU, then a product over the 4,864-wide
intermediate), each a pass over memory. `layers_native.c` does each in one pass, rounding where
the modules round (bf16 results are torch's, bit for bit on the shapes the tests try; float32 to
arithmetic order). The model stays a transformers model: only these modules are replaced, their
weights and the packed linear layers kept as they are; with no C compiler, or on another device,
nothing is replaced (the fallback is transformers' own modules).

SiLU * up is replaced only where the kernel's build runs it 16 lanes at a time (AVX-512 with
bf16): the loops a compiler makes of it for older CPUs are several times slower than torch's
(`python -m bench.fused_layers` measures every build).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kv_native import NativeKernel

log = logging.getLogger(__name__)

NORMS = frozenset({"Qwen2RMSNorm", "LlamaRMSNorm"})
MLPS = frozenset({"Qwen2MLP", "LlamaMLP"})


class NativeRMSNorm(nn.Module):
    """transformers' RMSNorm (weight * normalised x, in float32 between) by the native kernel."""

    def __init__(self, norm: nn.Module, kernel: NativeKernel) -> None:
        super().__init__()
        weight = norm.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{type(norm).__name__} has no weight tensor")
        self.weight = weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.rms_norm(x.contiguous(), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, native"


class NativeMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the activation and product in one pass by the native kernel."""

    def __init__(self, mlp: nn.Module, kernel: NativeKernel) -> None:
        super().__init__()
        parts = [getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(part, nn.Module) for part in parts):
            raise TypeError(f"{type(mlp).__name__} lacks its projections")
        self.gate_proj, self.up_proj, self.down_proj = parts
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.kernel.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return out


def _silu_mlp(module: nn.Module) -> bool:
    """An MLP of the supported shape whose activation is SiLU (and no tensor-parallel split)."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    split = getattr(config, "pretraining_tp", 1)
    parts = all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
    return act == "silu" and split == 1 and parts


def fuse_layers(model: nn.Module, kernel: NativeKernel | None, device: torch.device) -> int:
    """Replaces the model's RMSNorm modules by `NativeRMSNorm` and, where the kernel's build runs
    SiLU * up faster than torch (`NativeKernel.fuses_mlp`), its SiLU MLPs by `NativeMLP`; returns
    how many modules were replaced (0 without a kernel, off the CPU, or in another dtype)."""
    dtype = next(model.parameters()).dtype
    if kernel is None or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in NORMS and getattr(child, "weight", None) is not None and child.weight.dtype == dtype:
                setattr(parent, name, NativeRMSNorm(child, kernel))
            elif kind in MLPS and kernel.fuses_mlp and _silu_mlp(child):
                setattr(parent, name, NativeMLP(child, kernel))
            else:
                continue
            replaced += 1
    what = "RMSNorm and SiLU * up" if kernel.fuses_mlp else "RMSNorm"
    log.info("%s by the native kernel (%d modules)", what, replaced)
    return replaced
