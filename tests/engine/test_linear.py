"""Prepacked linear weights: the same products as `nn.Linear`, the same model outputs, and the
plain modules wherever packing does not apply."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.linear import PackedLinear, can_pack, pack_linears, reclaim_mapped_pages
from engine.tiny import Architecture, build_tiny

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not can_pack(CPU, torch.bfloat16), reason="this CPU's oneDNN has no native bf16: nothing is packed"
)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_what_the_linear_computes(rows: int, bias: bool) -> None:
    """Any number of rows (the layout is planned for 32), with and without bias, 2-D and 3-D."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for x in (torch.randn(rows, 96, dtype=torch.bfloat16), torch.randn(1, rows, 96, dtype=torch.bfloat16)):
        torch.testing.assert_close(packed(x), linear(x))


@needs_bf16
@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_a_packed_model_gives_the_logits_of_the_plain_one(architecture: Architecture) -> None:
    plain = build_tiny(architecture, dtype=torch.bfloat16)
    packed = build_tiny(architecture, dtype=torch.bfloat16)
    count = sum(type(m) is nn.Linear for m in packed.model.model.layers.modules())
    assert pack_linears(packed.model, CPU, torch.bfloat16) == count > 0
    assert not any(type(m) is nn.Linear for m in packed.model.model.layers.modules())
    assert type(packed.model.lm_head) is nn.Linear  # the head stays: it may share the embeddings
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(packed.model(ids).logits, plain.model(ids).logits)


def test_fp32_and_other_devices_keep_the_plain_modules() -> None:
    """The fallback: fp32 (every exactness test runs in it) is never packed."""
    tiny = build_tiny("qwen2", dtype=torch.float32)
    assert pack_linears(tiny.model, CPU, torch.float32) == 0
    assert not can_pack(torch.device("cuda"), torch.bfloat16)
    assert not any(isinstance(m, PackedLinear) for m in tiny.model.modules())


def test_reclaiming_a_weight_files_pages_keeps_its_contents(tmp_path: Path) -> None:
    """After packing, the loaded file's mapped pages are handed back to the kernel: the mapping is
    advised (Linux) and what is read through it afterwards is still the file's bytes."""
    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "model.safetensors").write_bytes(data)
    with (tmp_path / "model.safetensors").open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[:] == data  # every page read: resident
        advised = reclaim_mapped_pages(tmp_path)
        assert advised >= len(data) or not Path("/proc/self/maps").exists()
        assert m[:] == data
    assert reclaim_mapped_pages(tmp_path / "elsewhere") == 0
