"""A decoder layer's RMSNorm, its MLP's SiLU(gate) * up and its attention module's rotary
embedding by the engine's C kernels, on a CPU.

transformers runs RMSNorm as seven operators (conversion, square, mean, rsqrt, two products,
conversion), the MLP's activation as two (SiLU, then a product over the 4,864-wide
intermediate) and the rotary embedding as a dozen (slices, negation, concatenation, products and
sums, once for the queries and once for the keys), each a pass over memory. `layers_native.c`
does each in one pass, rounding where the modules round (bf16 results are torch's, bit for bit
on the shapes the tests try; float32 to arithmetic order). The attention module also computes
q, k and v by one product (their weights concatenated at load, as vLLM does) instead of three.
The model stays a transformers model: only these modules are replaced, their weights and the
packed linear layers kept as they are, and the attention module still calls the model's
attention function; with no C compiler, or on another device, nothing is replaced (the fallback
is transformers' own modules).

SiLU * up is replaced only where the kernel's build runs it 16 lanes at a time (AVX-512 with
bf16): the loops a compiler makes of it for older CPUs are several times slower than torch's
(`python -m bench.fused_layers` measures every build).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.kv_native import NativeKernel

log = logging.getLogger(__name__)

NORMS = frozenset({"Qwen2RMSNorm", "LlamaRMSNorm"})
MLPS = frozenset({"Qwen2MLP", "LlamaMLP"})
ATTENTIONS = frozenset({"Qwen2Attention", "LlamaAttention"})


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


class NativeAttention(nn.Module):
    """transformers' Qwen2/Llama attention module with q, k and v by one product and the rotary
    embedding turned in place on its output by the native kernel; then the model's attention
    function and the output projection, as the module it replaces calls them."""

    def __init__(self, attention: Any, kernel: NativeKernel, fallback: Callable[..., Any]) -> None:
        super().__init__()  # `attention`: a Qwen2Attention or LlamaAttention that `_plain_attention` took
        parts: list[nn.Linear] = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.config = attention.config
        self.layer_idx: int = attention.layer_idx
        self.head_dim: int = attention.head_dim
        self.scaling: float = attention.scaling
        self.num_key_value_groups: int = attention.num_key_value_groups
        self.sliding_window = getattr(attention, "sliding_window", None)
        self.attention_dropout = attention.attention_dropout
        self.is_causal = True
        self.widths = [int(part.out_features) for part in parts]  # q, k, v
        self.turned_heads = (self.widths[0] + self.widths[1]) // self.head_dim  # queries' and keys'
        self.qkv_proj: nn.Module = _concatenated(parts)  # packed by `pack_linears` afterwards
        self.o_proj: nn.Module = attention.o_proj
        self.kernel = kernel
        self.fallback = fallback  # the model's eager attention, for models loaded with "eager"

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv: torch.Tensor = self.qkv_proj(hidden_states)
        cos, sin = position_embeddings
        self.kernel.rotary(qkv, cos.contiguous(), sin.contiguous(), self.turned_heads, self.head_dim)
        parts = torch.split(qkv, self.widths, dim=-1)
        query, key, value = (x.view(hidden_shape).transpose(1, 2) for x in parts)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.fallback)
        out, weights = attend(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )  # fmt: skip
        projected: torch.Tensor = self.o_proj(out.reshape(*input_shape, -1).contiguous())
        return projected, weights

    def extra_repr(self) -> str:
        return f"q, k, v {self.widths} by one product, rotary embedding native"


def _concatenated(parts: list[nn.Linear]) -> nn.Linear:
    """One `nn.Linear` whose outputs are those of `parts` side by side (their weights and biases
    concatenated: each output column is computed from its own row of the weight, as before)."""
    weight = torch.cat([part.weight.detach() for part in parts])
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    biases = [part.bias.detach() for part in parts if part.bias is not None]
    if biases:
        merged.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return merged


def _plain_attention(module: nn.Module, dtype: torch.dtype) -> Callable[..., Any] | None:
    """The eager attention function of the module's model family, where the module has the shape
    `NativeAttention` takes (plain q/k/v projections of `dtype`, all with biases or none, an even
    head size); else None."""
    parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears = [part for part in parts if type(part) is nn.Linear and part.weight.dtype == dtype]
    if len(linears) != len(parts):
        return None
    if len({part.bias is None for part in linears[:3]}) != 1 or getattr(module, "head_dim", 1) % 2:
        return None
    family = inspect.getmodule(type(module))
    fallback = getattr(family, "eager_attention_forward", None)
    return fallback if callable(fallback) else None


def _silu_mlp(module: nn.Module) -> bool:
    """An MLP of the supported shape whose activation is SiLU (and no tensor-parallel split)."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    split = getattr(config, "pretraining_tp", 1)
    parts = all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
    return act == "silu" and split == 1 and parts


def fuse_layers(model: nn.Module, kernel: NativeKernel | None, device: torch.device) -> int:
    """Replaces the model's RMSNorm modules by `NativeRMSNorm`, its attention modules by
    `NativeAttention` and, where the kernel's build runs SiLU * up faster than torch
    (`NativeKernel.fuses_mlp`), its SiLU MLPs by `NativeMLP`; returns how many modules were
    replaced (0 without a kernel, off the CPU, or in another dtype). Before `pack_linears`: the
    attention's projections are concatenated from plain `nn.Linear` weights."""
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
            elif kind in ATTENTIONS and (fallback := _plain_attention(child, dtype)) is not None:
                setattr(parent, name, NativeAttention(child, kernel, fallback))
            else:
                continue
            replaced += 1
    what = "RMSNorm, rotary embedding, q/k/v in one product" + (" and SiLU * up" if kernel.fuses_mlp else "")
    log.info("%s by the native kernel (%d modules)", what, replaced)
    return replaced
