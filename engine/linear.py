"""Linear layers whose weights are reordered once, at load, into oneDNN's blocked layout.

`torch.nn.functional.linear` on a CPU reorders (packs) a bf16 weight for the matrix unit at every
call, and in fp32 hands small products to a BLAS that reads the plain row-major weight; for the
engine's small matrices (a decode step multiplies 16-32 rows by a 896x4864 weight) either costs
as much as the product should. vLLM's CPU path and torch's inductor (freezing) pack once; this
does the same for every `nn.Linear` of the decoder layers and for the output head, keeping the
model a plain transformers model: only the modules' weights change layout. Packed on a CPU for
fp32 and, where oneDNN computes bf16 natively, bf16; anything else keeps `nn.Linear` (the
fallback). A packed product of a row does not depend on the other rows of the batch.
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
    """`nn.Linear`'s product with the weight held in oneDNN's layout (fp32 or bf16, CPU)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, keep_rows: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # The output head's plain weight, for the few rows recomputed in fp32 (`engine.runner.
        # exact_head`): the loaded weights are mapped from their files, so holding it keeps file
        # pages (read back a row at a time), not a copy.
        self.rows = weight if keep_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch._C._has_mkldnn:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_targets(model: nn.Module, dtype: torch.dtype | None = None) -> list[tuple[nn.Module, str]]:
    """Where the decoder layers' plain `nn.Linear` modules (of `dtype`, when given) and the output
    head sit, as (parent, attribute name), the head last: what a format of the weights replaces.
    Names only: holding the modules themselves would keep every replaced weight alive."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return []

    def plain(module: nn.Module | None) -> bool:
        return type(module) is nn.Linear and (dtype is None or module.weight.dtype == dtype)

    targets = [
        (parent, name)
        for layer in layers
        for parent in list(layer.modules())
        for name, child in parent.named_children()
        if plain(child)
    ]
    if plain(getattr(model, "lm_head", None)):
        targets.append((model, "lm_head"))
    return targets


def pack_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype, weights_folder: Path | None = None
) -> int:
    """Replaces the decoder layers' `nn.Linear` modules and the output head by `PackedLinear`
    where `can_pack`; returns how many were replaced (none if oneDNN refuses the first: some
    builds cannot reorder on every CPU, and a half-packed model would be no faster).

    A head tied to the embeddings (small models) gets a packed copy of the vocabulary matrix
    while the embeddings keep theirs for lookups: more memory (logged) for the product every step
    makes, over the whole vocabulary, for every sampling row.

    transformers maps the weight files into memory and the mapping outlives the replaced
    weights (the embeddings still live in it); packing read every page of them, so those pages
    would stay resident beside their packed copies (+0.6 GiB RSS at 0.5B in bf16). With
    `weights_folder`, the mapped pages of its files are handed back to the kernel afterwards
    (`madvise(PAGEOUT)`: contents unchanged, the pages still used come back from the file on
    their next read)."""
    if not can_pack(device, dtype):
        return 0
    targets = linear_targets(model, dtype)
    if not targets:
        return 0
    head = getattr(model, "lm_head", None)
    embeddings = getattr(getattr(model, "model", model), "embed_tokens", None)
    shared = getattr(embeddings, "weight", None) is getattr(head, "weight", None)
    if targets[-1] == (model, "lm_head") and shared:
        extra = head.weight.numel() * head.weight.element_size()  # type: ignore[union-attr]
        log.info("the output head shares the embeddings: its packed copy adds %.0f MiB", extra / 2**20)
    del head
    try:  # the first one tells whether this build's oneDNN can reorder here at all
        first = PackedLinear(getattr(*targets[0]))
    except RuntimeError as exc:
        log.warning("linear weights left unpacked: %s", exc)
        return 0
    setattr(*targets[0], first)
    del first
    for parent, name in targets[1:]:  # one at a time: each plain weight is freed before the next
        head = parent is model and name == "lm_head" and dtype != torch.float32
        setattr(parent, name, PackedLinear(getattr(parent, name), keep_rows=head))
        release_freed_heap()  # at once, or the peak holds both copies of most weights
    log.info("packed %d linear weights for oneDNN (%s)", len(targets), str(dtype).removeprefix("torch."))
    if weights_folder is not None:
        reclaim_mapped_pages(weights_folder)
    return len(targets)


def release_freed_heap() -> bool:
    """Hands the heap's freed pages back to the kernel (glibc's `malloc_trim`; False where there is
    none). The plain fp32 weights freed by packing stay resident otherwise: +1.3 GiB RSS at 0.5B,
    which the allocator would reuse only for allocations of the same sizes."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


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
