"""Linear layers whose bf16 weights are reordered once, at load, into oneDNN's blocked layout.

`torch.nn.functional.linear` on a CPU reorders (packs) the weight for the matrix unit at every
call; for the engine's small matrices (a decode step multiplies 16-32 rows by a 896x4864 weight)
that repacking is a large share of the product. vLLM's CPU path and torch's inductor (freezing)
pack once; this does the same for every `nn.Linear` of the decoder layers, keeping the model a
plain transformers model: only the modules' weights change layout. Packed only for bf16 on a CPU
whose oneDNN computes bf16 natively; anything else keeps `nn.Linear` (the fallback).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

BATCH_HINT = 32  # rows oneDNN plans the layout for; products of any row count remain exact
_MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now (contents kept: they refault from the file)


class PackedLinear(nn.Module):
    """`nn.Linear`'s product with the weight held in oneDNN's layout (bf16, CPU)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and bool(torch._C._has_mkldnn)
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype, weights_folder: Path | None = None
) -> int:
    """Replaces the decoder layers' `nn.Linear` modules by `PackedLinear` where `can_pack`;
    returns how many were replaced. The output head (tied to the embeddings in small models)
    is left as it is: packing it would hold a second copy of the vocabulary matrix.

    transformers maps the weight files into memory and the mapping outlives the replaced
    weights (the embeddings still live in it); packing read every page of them, so those pages
    would stay resident beside their packed copies (+0.6 GiB RSS at 0.5B). With `weights_folder`,
    the mapped pages of its files are handed back to the kernel afterwards (`madvise(PAGEOUT)`:
    contents unchanged, the pages still used come back from the file on their next read)."""
    if not can_pack(device, dtype):
        return 0
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        return 0
    replaced = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.weight.dtype == dtype:
                    setattr(parent, name, PackedLinear(child))
                    replaced += 1
    log.info("packed %d linear weights for oneDNN (bf16)", replaced)
    if weights_folder is not None:
        reclaim_mapped_pages(weights_folder)
    return replaced


def reclaim_mapped_pages(folder: Path) -> int:
    """Asks the kernel to reclaim this process's mapped pages of files under `folder`; returns the
    bytes of mapping advised (0 where /proc or madvise are not available: a hint, never an error)."""
    prefix = str(folder.resolve())
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start, _MADV_PAGEOUT) == 0:
                advised += end - start
    return advised
