"""RMSNorm, SiLU * up and the rotary embedding by the native kernels, q/k/v by one product
(`engine.fused`, `layers_native.c`): what transformers' modules compute, on every build this CPU
runs, and the engine's greedy tokens still those of recomputation with them in the model."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from engine import Engine, EngineConfig, SamplingParams, kv_native, load_model
from engine.fused import NativeAttention, NativeMLP, NativeRMSNorm, fuse_layers
from engine.kv_native import NativeKernel, NativeKernelError
from engine.linear import PackedLinear
from engine.selftest import recompute
from engine.tiny import build_tiny
from tests.engine.test_kv_compression import native_kernel, runnable_builds
from tests.engine.test_loader import save_tiny


def builds() -> list[tuple[str, NativeKernel]]:
    """This CPU's build and the AVX2 and portable ones it also runs."""
    found = [("native", native_kernel())]
    for march, _ in runnable_builds():
        kernel = kv_native.load(march)
        assert kernel is not None
        found.append((march, kernel))
    return found


# bf16: one rounding apart at most (float32 sums in another order); float32: arithmetic order
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm_type", [Qwen2RMSNorm, LlamaRMSNorm])
def test_every_build_normalises_as_transformers_rmsnorm(norm_type: type, dtype: torch.dtype) -> None:
    """Rows of 896 (the default model's) and 24 channels (the loop's tail), 1 to 37 rows."""
    gen = torch.Generator().manual_seed(0)
    for channels in (896, 24):
        norm = norm_type(channels, eps=1e-6).to(dtype)
        norm.weight.data = torch.randn(channels, generator=gen).to(dtype)
        for rows in (1, 37):
            x = (torch.randn(1, rows, channels, generator=gen) * 3).to(dtype)
            expected = norm(x)
            for label, kernel in builds():
                got = NativeRMSNorm(norm, kernel)(x)
                assert got.dtype == dtype and got.shape == x.shape
                tol, where = TOLERANCE[dtype], f"{label} {channels}x{rows}"
                torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=where)
                if dtype == torch.bfloat16:  # rounded where torch rounds: nearly every value identical
                    assert (got == expected).float().mean() > 0.99, label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_build_computes_silu_times_up_as_torch(dtype: torch.dtype) -> None:
    """Gates from -90 to 90 (exp never overflows), lengths either side of 16 lanes and of a thread's
    stretch: silu(gate) * up as torch's two operators round it."""
    gen = torch.Generator().manual_seed(1)
    for count in (5, 16, 4096 * 2 + 7):
        gate = (torch.randn(count, generator=gen) * 6).to(dtype)
        gate[:3] = torch.tensor([-90.0, 90.0, 0.0])
        up = torch.randn(count, generator=gen).to(dtype)
        expected = F.silu(gate) * up
        for label, kernel in builds():
            got = kernel.silu_mul(gate, up)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"{label} {count}")
            if dtype == torch.bfloat16:  # silu rounded to bf16 before the product, as torch does
                usual = gate.abs() < 80  # below exp(-87) the kernel's exp stops (results ~1e-36)
                assert (got == expected)[usual].float().mean() > 0.99, label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_build_turns_queries_and_keys_as_transformers_rotary_embedding(dtype: torch.dtype) -> None:
    """Queries and keys side by side in the rows of one q/k/v product (14 query heads and 2 KV
    heads, the default model's; head sizes 64, 128 and 6), angles of positions up to 30,000: the
    queries' and keys' heads turned in place exactly as `apply_rotary_pos_emb` computes and rounds
    them, the values untouched."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads = 14, 2
    for dim in (64, 128, 6):
        for rows in (1, 37):
            qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)
            positions = torch.randint(0, 30_000, (rows, 1), generator=gen).float()
            angles = positions / 10_000 ** (torch.arange(0, dim, 2).float() / dim)
            angles = torch.cat((angles, angles), dim=-1)[None]  # (1, rows, dim), as transformers builds them
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q_turned, k_turned = apply_rotary_pos_emb(
                q.view(1, rows, heads, dim).transpose(1, 2), k.view(1, rows, kv_heads, dim).transpose(1, 2),
                cos, sin,
            )  # fmt: skip
            turned = [x.transpose(1, 2).reshape(1, rows, -1) for x in (q_turned, k_turned)]
            expected = torch.cat((*turned, v), dim=-1)
            for label, kernel in builds():
                got = qkv.clone()
                kernel.rotary(got, cos, sin, heads + kv_heads, dim)
                assert torch.equal(got, expected), f"{label} {dtype} head size {dim}, {rows} rows"


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    kernel = native_kernel()
    x = torch.randn(4, 8)
    with pytest.raises(NativeKernelError, match="contiguous"):
        kernel.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(NativeKernelError, match="weight"):
        kernel.rms_norm(x, torch.ones(5), 1e-6)
    with pytest.raises(NativeKernelError, match="dtypes"):
        kernel.silu_mul(x, x.to(torch.bfloat16))
    with pytest.raises(NativeKernelError, match="differ"):
        kernel.silu_mul(x, x[:2].contiguous())
    angles = torch.ones(4, 4)
    with pytest.raises(NativeKernelError, match="heads"):
        kernel.rotary(x.clone(), angles, angles, 3, 4)  # 12 channels of rows of 8
    with pytest.raises(NativeKernelError, match="angles"):
        kernel.rotary(x.clone(), angles[:3], angles[:3], 2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_model_gives_the_logits_of_transformers_modules(dtype: torch.dtype) -> None:
    """Every RMSNorm and attention module and, on a build that runs SiLU * up faster than torch,
    every MLP replaced; the model's logits those of the unfused model to rounding, over a whole
    prompt and over a prompt then one more token through transformers' own cache. A build without
    the fast SiLU loop keeps transformers' MLPs."""
    kernel = native_kernel()
    for architecture in ("qwen2", "llama"):
        plain, fused = build_tiny(architecture, dtype=dtype), build_tiny(architecture, dtype=dtype)
        replaced = fuse_layers(fused.model, kernel, torch.device("cpu"))
        norms = [m for m in fused.model.modules() if isinstance(m, NativeRMSNorm)]
        mlps = [m for m in fused.model.modules() if isinstance(m, NativeMLP)]
        attentions = [m for m in fused.model.modules() if isinstance(m, NativeAttention)]
        assert len(norms) == 2 * 2 + 1 and len(attentions) == 2  # two norms a layer, the final one
        assert len(mlps) == (2 if kernel.fuses_mlp else 0)
        assert replaced == len(norms) + len(mlps) + len(attentions)
        ids = torch.tensor([list(range(3, 40))])
        with torch.inference_mode():
            expected, got = plain.model(ids).logits, fused.model(ids).logits
            cache = DynamicCache(config=fused.model.config)
            fused.model(ids[:, :-1], cache=cache, use_cache=True)
            last = fused.model(ids[:, -1:], cache=cache, use_cache=True).logits
        tol = 0.05 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=architecture)
        torch.testing.assert_close(last[:, -1], expected[:, -1], rtol=tol, atol=tol, msg=architecture)
    loops = build_tiny(dtype=dtype)
    fuse_layers(loops.model, replace(kernel, layers_isa="loops"), torch.device("cpu"))
    assert not any(isinstance(m, NativeMLP) for m in loops.model.modules())


def test_a_loaded_model_packs_the_fused_attentions_one_q_k_v_product(tmp_path: Path) -> None:
    """`load_model` fuses before it packs: each attention module's q, k and v are one packed
    product of their concatenated weights, which gives the three products' outputs side by side."""
    folder = save_tiny(tmp_path / "tiny")
    loaded = load_model(folder, device="cpu", dtype="float32")
    plain = build_tiny(dtype=torch.float32)
    attentions = [m for m in loaded.model.modules() if isinstance(m, NativeAttention)]
    assert len(attentions) == 2
    x = torch.randn(1, 5, plain.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer, attention in zip(plain.model.model.layers, attentions, strict=True):
        assert isinstance(attention.qkv_proj, PackedLinear) and isinstance(attention.o_proj, PackedLinear)
        parts = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        with torch.inference_mode():
            expected = torch.cat([part(x) for part in parts], dim=-1)
            torch.testing.assert_close(attention.qkv_proj(x), expected, rtol=1e-5, atol=1e-5)


async def test_the_engine_with_fused_layers_generates_what_recomputation_does() -> None:
    """fp32, greedy, three requests batched in 8-token chunks (16 while all three are held: the
    saturated budget): token for token what the same model (its modules fused) gives by full
    recomputation."""
    tiny = build_tiny()
    assert fuse_layers(tiny.model, native_kernel(), torch.device("cpu")) > 0
    config = EngineConfig(
        model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, dynamic_batching=True,
        max_batch_size=3, max_tokens_per_step=8,
    )  # fmt: skip
    async with Engine(config, tiny) as engine:
        prompts = [engine.format_chat([{"role": "user", "content": "fee " * (4 * i + 1)}]) for i in range(3)]
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == recompute(tiny, prompt, 8)
