"""Prepacked linear weights: the same products as `nn.Linear`, the same model outputs, each row's
product independent of its batch, and the plain modules wherever packing does not apply."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.linear import PackedLinear, can_pack, pack_linears, reclaim_mapped_pages
from engine.tiny import Architecture, build_tiny

CPU = torch.device("cpu")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(
            not can_pack(CPU, torch.bfloat16), reason="this CPU's oneDNN has no native bf16: bf16 stays plain"
        ),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_what_the_linear_computes(dtype: torch.dtype, rows: int, bias: bool) -> None:
    """Any number of rows (the layout is planned for 32), with and without bias, 2-D and 3-D."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for x in (torch.randn(rows, 96, dtype=dtype), torch.randn(1, rows, 96, dtype=dtype)):
        torch.testing.assert_close(packed(x), linear(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_rows_product_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """What keeps the engine's outputs exact whatever it batches: a row alone and the same row
    among 63 others give the same bits."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, 160).to(dtype))
    x = torch.randn(64, 96, dtype=dtype)
    with torch.inference_mode():
        together = packed(x)
        for row in (0, 5, 63):
            assert torch.equal(packed(x[row : row + 1]), together[row : row + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_a_packed_model_gives_the_logits_of_the_plain_one(
    architecture: Architecture, dtype: torch.dtype
) -> None:
    """Every decoder linear and the output head are packed; the embeddings keep their lookups
    (the tiny Qwen2 ties its head to them, the tiny Llama does not)."""
    plain = build_tiny(architecture, dtype=dtype)
    packed = build_tiny(architecture, dtype=dtype)
    count = sum(type(m) is nn.Linear for m in packed.model.model.layers.modules()) + 1
    assert pack_linears(packed.model, CPU, dtype) == count > 1
    assert not any(type(m) is nn.Linear for m in packed.model.modules())
    assert isinstance(packed.model.lm_head, PackedLinear)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(packed.model(ids).logits, plain.model(ids).logits)


def test_other_devices_and_dtypes_keep_the_plain_modules() -> None:
    """The fallback: nothing is packed off the CPU or in half precision."""
    tiny = build_tiny("qwen2", dtype=torch.float16)
    assert pack_linears(tiny.model, CPU, torch.float16) == 0
    assert not can_pack(torch.device("cuda"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)
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
