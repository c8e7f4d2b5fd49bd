"""Decode attention read in place by the native kernel (`attention_native.c`): what attention over
the same keys and values computed by hand gives, on every build this CPU runs, and the same
tokens as torch's gathered path in the engine."""

from __future__ import annotations

import asyncio
import re
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, kv_native
from engine.attention import SeqSlice, decode_attention, group_decodes, in_place_attention, in_place_decodes
from engine.kv_cache import ColdStore, KVCache, KVShape, slots_of
from engine.kv_native import NativeKernel, NativeKernelError
from engine.kv_quant import LayerFormat, QuantFormat, head_codes, stored_centred
from engine.loader import LoadedModel
from engine.tiny import build_tiny
from tests.engine.test_kv_compression import native_kernel, runnable_builds

# 1: a lone token; 15, 17: either side of a 16-key tile; 70, 200: past a 64-key value tile
LENGTHS = (1, 15, 17, 70, 200)


def every_build() -> list[tuple[str, NativeKernel]]:
    """(label, kernel) for each path this CPU runs: its own build, that build without AMX tiles
    where it has them (the AVX-512 path of CPUs without AMX), and the AVX2 and portable builds."""
    kernel = native_kernel()
    builds = [(f"native ({kernel.decode_isa(torch.bfloat16, 64)})", kernel)]
    if kernel.tiles:
        builds.append((f"native without tiles ({kernel.attention_isa})", replace(kernel, tiles=False)))
    for march, isa in runnable_builds():
        other = kv_native.load(march)
        assert other is not None
        builds.append((f"{march} ({isa})", other))
    return builds


def prompt_builds() -> list[tuple[str, NativeKernel]]:
    """(label, kernel) for each path this CPU attends bf16 prompt chunks in place with: its AMX tiles
    where it has them, and the AVX-512 BF16 vectors (alone where there are no tiles); none on
    older CPUs (there torch's SDPA attends them)."""
    kernel = native_kernel()
    if kernel.prompt_isa(torch.bfloat16, 64) is None:
        pytest.skip("prompt chunks are attended in place only by the AVX-512 BF16 and AMX builds")
    builds = [(str(kernel.prompt_isa(torch.bfloat16, 64)), kernel)]
    if kernel.tiles:
        builds.append(("avx512-bf16", replace(kernel, tiles=False)))
    return builds


def paged_cache(
    shape: KVShape, lengths: tuple[int, ...], seed: int, size: int = 16
) -> tuple[KVCache, list[SeqSlice]]:
    """A cache of random keys and values, each sequence's blocks (`size` tokens) scattered over the pool."""
    tables = [-(-n // size) for n in lengths]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(sum(tables) + 3, generator=gen).tolist()
    cache = KVCache(shape, len(order), size, torch.device("cpu"))
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    seqs, used = [], 0
    for i, (n, blocks) in enumerate(zip(lengths, tables, strict=True)):
        seqs.append(SeqSlice(i, 1, slots_of(order[used : used + blocks], n, size)))
        used += blocks
    return cache, seqs


def by_hand(query: torch.Tensor, cache: KVCache, seq: SeqSlice, scale: float) -> torch.Tensor:
    """(H, D) in float64: query head kv * G + g against KV head kv."""
    keys, values = (t[0, seq.kv_slots].double().transpose(0, 1) for t in (cache.keys, cache.values))
    q = query[:, seq.q_start].double().view(keys.shape[0], -1, keys.shape[2])  # (KVH, G, D)
    probs = torch.softmax(q @ keys.transpose(1, 2) * scale, dim=-1)  # (KVH, G, L)
    return (probs @ values).flatten(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 64, 128: AVX-512 (and AMX) tiles; 24: the loops
@pytest.mark.parametrize("block", [16, 8])  # 8: a tile of 16 keys spans two blocks, maybe apart
@pytest.mark.parametrize("groups", [7, 12])  # query heads to a KV head: the default model's, and over 8
def test_every_build_attends_in_place_as_attention_by_hand(
    head_dim: int, dtype: torch.dtype, block: int, groups: int
) -> None:
    """Sequences of 1 to 200 tokens in scattered blocks, 7 or 12 query heads to a KV head: each
    build (this CPU's, without its AMX tiles where it has them, and the AVX2 and portable ones it
    also runs) gives float64 attention over the same keys and values, to float32 rounding (bf16:
    the output's one rounding; where bf16 values are weighed as bf16 (AVX-512 BF16 vectors, AMX
    tiles), each probability's rounding to bf16 too)."""
    native_kernel()
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    cache, seqs = paged_cache(shape, LENGTHS, seed=head_dim, size=block)
    heads = 2 * groups
    query = torch.randn(heads, len(seqs), head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale = head_dim**-0.5
    decodes, rest = in_place_decodes(seqs)
    assert decodes is not None and not rest
    expected = torch.stack([by_hand(query, cache, seq, scale) for seq in seqs])
    step = 2**-8 if dtype == torch.bfloat16 else 1e-6
    for label, kernel in every_build():
        cache.kernel = kernel
        got = in_place_attention(query, cache, 0, decodes, scale)
        assert got.dtype == dtype and got.shape == (len(seqs), heads, head_dim)
        torch.testing.assert_close(got.double(), expected, rtol=step, atol=step, msg=label)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_a_history_attend_each_as_alone(dtype: torch.dtype) -> None:
    """A decode and its draft tokens are rows over one history, each a token longer, laid side by
    side (the kernel gives such rows to one thread): each row still attends to its own tokens
    alone, as by hand, beside sequences of one row, on every build."""
    native_kernel()
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, dtype=dtype)
    cache, alone = paged_cache(shape, (90, 33, 140), seed=11)
    rows: list[SeqSlice] = []
    for seq, drafts in zip(alone, (3, 0, 1), strict=True):
        n = seq.kv_slots.shape[0]
        rows += [SeqSlice(len(rows), 1, seq.kv_slots[: n - drafts + i]) for i in range(drafts + 1)]
    query = torch.randn(14, len(rows), 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    decodes, rest = in_place_decodes(rows)
    assert decodes is not None and not rest
    expected = torch.stack([by_hand(query, cache, row, 0.125) for row in rows])
    step = 2**-8 if dtype == torch.bfloat16 else 1e-6
    for label, kernel in every_build():
        cache.kernel = kernel
        got = in_place_attention(query, cache, 0, decodes, 0.125)
        torch.testing.assert_close(got.double(), expected, rtol=step, atol=step, msg=label)


# Two KV heads whose keys and values hold four different formats (keys 6 and 8 bits, values 4 and 6).
MIXED = LayerFormat((QuantFormat(6), QuantFormat(8)), (QuantFormat(4), QuantFormat(6)))
FORMATS = {"8": QuantFormat(8), "6": QuantFormat(6), "4": QuantFormat(4), "parts": MIXED}


def with_quantised_history(shape: KVShape, name: str, seed: int) -> tuple[KVCache, list[SeqSlice]]:
    """A cache with a quantised store of random blocks (`FORMATS[name]`): sequence 0 holds 5 of them
    and 7 full-precision tokens, sequence 1 none and 20 tokens, sequence 2 one and 1 token (in a
    block after 3's)."""
    size, gen = 16, torch.Generator().manual_seed(seed)
    store = ColdStore(shape, (FORMATS[name],), 8, size, torch.device("cpu"))
    blocks = torch.randn(2, 1, 8, size, shape.num_kv_heads, shape.head_dim, generator=gen)
    store.store(blocks[0].to(shape.dtype), blocks[1].to(shape.dtype), torch.arange(8))
    cache = KVCache(shape, 6, size, torch.device("cpu"), store)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    cold = [torch.tensor([6, 0, 3, 7, 1]), None, torch.tensor([4])]
    hot = [slots_of([2], 7, size), slots_of([0, 5], 20, size), slots_of([4], 1, size)]
    seqs = [
        SeqSlice(i, 1, h, c, 0 if c is None else c.shape[0] * size)
        for i, (h, c) in enumerate(zip(hot, cold, strict=True))
    ]
    return cache, seqs


def dequantised_by_hand(cache: KVCache, seq: SeqSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's keys and values (KVH, L, D) in float64: centred code * scale + offset of its
    quantised blocks, then its full-precision tokens."""
    keys, values = (t[0, seq.kv_slots].double().transpose(0, 1) for t in (cache.keys, cache.values))
    if seq.cold_blocks is None or cache.cold is None:
        return keys, values
    stored, fmt, b = cache.cold.layer(0), cache.cold.formats[0], seq.cold_blocks
    dim = cache.shape.head_dim

    def codes(packed: torch.Tensor, values: bool) -> torch.Tensor:  # (m, KVH, bs, D), centred
        parts = fmt.parts(values)
        heads = [
            stored_centred(head_codes(packed, fmt, h, values, dim)[b], part) for h, part in enumerate(parts)
        ]
        return torch.stack(heads, dim=1).double()

    k = codes(stored.key_codes, False) * stored.key_scale[b].double()[:, :, None]
    k = k + stored.key_offset[b].double()[:, :, None]  # (m, KVH, bs, D): per channel of a block
    v = codes(stored.value_codes, True) * stored.value_scale[b].double()[..., None]
    v = v + stored.value_offset[b].double()[..., None]  # per token
    cold_keys, cold_values = (x.transpose(0, 1).flatten(1, 2) for x in (k, v))  # (KVH, m * bs, D)
    return torch.cat((cold_keys, keys), dim=1), torch.cat((cold_values, values), dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("formats", list(FORMATS))
def test_every_build_attends_to_quantised_blocks_in_place_as_dequantising_by_hand(
    formats: str, head_dim: int, dtype: torch.dtype
) -> None:
    """Quantised blocks out of order, sequences with and without them: each build gives float64
    attention over the history dequantised by hand, to float32 rounding (bf16: to bf16's, where
    the build weighs bf16 history as bf16 (AVX-512 BF16 vectors, AMX tiles) with the quantised
    blocks dequantised to bf16 rows and the probabilities rounded to bf16 first)."""
    native_kernel()
    cache, seqs = with_quantised_history(
        KVShape(1, 2, head_dim, dtype), formats, seed=list(FORMATS).index(formats) + head_dim
    )
    query = torch.randn(14, len(seqs), head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = head_dim**-0.5
    decodes, rest = in_place_decodes(seqs, cold=True)
    assert decodes is not None and not rest and decodes.cold_starts is not None
    assert decodes.cold_starts.tolist() == [0, 5, 5, 6]
    expected = []
    for seq in seqs:
        keys, values = dequantised_by_hand(cache, seq)
        q = query[:, seq.q_start].double().view(2, 7, head_dim)
        expected.append((torch.softmax(q @ keys.transpose(1, 2) * scale, dim=-1) @ values).flatten(0, 1))
    step = 2**-8 if dtype == torch.bfloat16 else 1e-6
    for label, kernel in every_build():
        cache.kernel = kernel
        got = in_place_attention(query, cache, 0, decodes, scale).double()
        torch.testing.assert_close(got, torch.stack(expected), rtol=step, atol=step, msg=label)


def test_in_place_and_gathered_decode_attention_agree() -> None:
    """The same step's decodes through torch's gathered, padded path: the same result to rounding."""
    native_kernel()
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    cache, seqs = paged_cache(shape, LENGTHS, seed=7)
    cache.kernel = native_kernel()
    query = torch.randn(14, len(seqs), 64, generator=torch.Generator().manual_seed(4))
    decodes, _ = in_place_decodes(seqs)
    assert decodes is not None
    in_place = in_place_attention(query, cache, 0, decodes, 0.125)
    for group in group_decodes(seqs, 2, 16, torch.device("cpu")):
        gathered = decode_attention(query, cache, 0, group, 0.125)
        torch.testing.assert_close(in_place[group.rows], gathered, rtol=1e-5, atol=1e-5)


def test_decodes_with_quantised_history_stay_on_the_gathered_path_unless_the_kernel_reads_them() -> None:
    hot = SeqSlice(0, 1, torch.arange(5))
    cold = SeqSlice(1, 1, torch.arange(5, 9), torch.tensor([0]), 16)
    decodes, rest = in_place_decodes([hot, cold])
    assert decodes is not None and rest == [cold]
    assert decodes.rows.tolist() == [0] and decodes.starts.tolist() == [0, 5]
    assert in_place_decodes([cold]) == (None, [cold])
    both, rest = in_place_decodes([hot, cold], cold=True)
    assert both is not None and both.cold_blocks is not None and both.cold_starts is not None and not rest
    assert both.starts.tolist() == [0, 5, 9] and both.cold_blocks.tolist() == [0]
    assert both.cold_starts.tolist() == [0, 0, 1]


def test_the_native_attention_refuses_what_it_cannot_read() -> None:
    kernel = native_kernel()
    keys = values = torch.zeros(8, 2, 16)
    query = torch.zeros(2, 4, 16)
    slots, starts = torch.tensor([0, 1, 7]), torch.tensor([0, 2, 3])
    assert kernel.decode_attention(query, keys, values, slots, starts, 0.25).shape == (2, 4, 16)
    with pytest.raises(NativeKernelError, match="out of range"):
        kernel.decode_attention(query, keys, values, torch.tensor([0, 1, 8]), starts, 0.25)
    with pytest.raises(NativeKernelError, match="without a full-precision token"):
        kernel.decode_attention(query, keys, values, slots, torch.tensor([0, 0, 3]), 0.25)
    with pytest.raises(NativeKernelError, match="from 0 to the number of slots"):
        kernel.decode_attention(query, keys, values, slots, torch.tensor([0, 2, 2]), 0.25)
    with pytest.raises(NativeKernelError, match="dtypes"):
        kernel.decode_attention(query.bfloat16(), keys, values, slots, starts, 0.25)
    with pytest.raises(NativeKernelError, match="one layer's cache"):
        kernel.decode_attention(torch.zeros(2, 3, 16), keys, values, slots, starts, 0.25)
    with pytest.raises(NativeKernelError, match="contiguous"):
        kernel.decode_attention(
            query.transpose(0, 1).contiguous().transpose(0, 1), keys, values, slots, starts, 0.25
        )


@pytest.fixture(scope="module")
def tiny(test_device: torch.device) -> LoadedModel:
    return build_tiny("qwen2", device=test_device)


async def test_in_place_and_gathered_decodes_generate_the_same_tokens(tiny: LoadedModel) -> None:
    """fp32, greedy, five requests batched: the engine decodes with the kernel on a CPU unless
    told KV_KERNEL=torch, and both give the same tokens."""
    if tiny.device.type != "cpu":
        pytest.skip("the native kernel is for CPU caches")
    kernel = native_kernel()

    async def run(**options: object) -> list[list[int]]:
        config = EngineConfig(
            model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, dynamic_batching=True,
            max_batch_size=5, block_size=4, max_tokens_per_step=16, **options,  # type: ignore[arg-type]
        )  # fmt: skip
        engine = Engine(config, tiny)
        async with engine:
            in_place = not options and kernel.attends_faster(torch.float32)
            assert engine.stats().decode_reader == (f"native-{kernel.attention_isa}" if in_place else "torch")
            prompts = [
                engine.format_chat([{"role": "user", "content": "fee " * (3 * i + 1)}]) for i in range(5)
            ]
            params = SamplingParams(max_new_tokens=12, ignore_eos=True)
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            assert engine.stats().largest_batch > 1
            return [r.token_ids for r in results]

    assert await run() == await run(kv_kernel="torch")


def chunk_by_hand(query: torch.Tensor, cache: KVCache, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """(q, H, D) in float64: a prompt chunk's queries (H, q, D), the last q of the tokens at `slots`,
    over them with a bottom-right causal mask."""
    keys, values = (t[0, slots].double().transpose(0, 1) for t in (cache.keys, cache.values))  # (KVH, L, D)
    heads, q_len, dim = query.shape
    kv_heads, kv_len = keys.shape[0], keys.shape[1]
    q = query.double().view(kv_heads, heads // kv_heads, q_len, dim)
    scores = q @ keys[:, None].transpose(2, 3) * scale  # (KVH, G, q, L)
    seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return (probs @ values[:, None]).reshape(heads, q_len, dim).transpose(0, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", [16, 8])
def test_prompt_chunks_attended_in_place_as_attention_by_hand(head_dim: int, block: int) -> None:
    """bf16 prompt chunks of 1 to 200 tokens over histories of 0 to 130 tokens in scattered blocks,
    queries strided as the model hands them over, seven query heads to a KV head: every path this
    CPU attends them in place with (AMX tiles, AVX-512 BF16 vectors) gives float64 causal
    attention to bf16 rounding (the output's, and the probabilities', as torch's flash attention
    rounds them); so does torch's SDPA."""
    chunks = ((17, 17), (40, 23), (200, 70), (33, 1), (64, 64), (130, 16))  # (history + chunk, chunk)
    shape = KVShape(1, 2, head_dim, torch.bfloat16)
    cache, seqs = paged_cache(shape, tuple(n for n, _ in chunks), seed=head_dim + block, size=block)
    gen = torch.Generator().manual_seed(5)
    for seq, (kv_len, q_len) in zip(seqs, chunks, strict=True):
        packed = torch.randn(1, q_len + 6, 14, head_dim, generator=gen).to(torch.bfloat16)
        query = packed.transpose(1, 2)[0, :, 3 : 3 + q_len]  # (H, q, D), tokens strided by H * D
        expected = chunk_by_hand(query, cache, seq.kv_slots, head_dim**-0.5)
        for label, kernel in prompt_builds():
            scale = head_dim**-0.5
            got = kernel.prefill_attention(query, cache.keys[0], cache.values[0], seq.kv_slots, scale)
            torch.testing.assert_close(
                got.double(), expected, rtol=2**-7, atol=2**-7, msg=f"{label}: {kv_len}, {q_len}"
            )


@pytest.mark.parametrize("formats", list(FORMATS))
def test_prompt_chunks_attend_in_place_to_quantised_history_as_dequantising_by_hand(formats: str) -> None:
    """bf16, quantised blocks out of order before the full-precision tokens (and a sequence with
    none): every in-place path (AMX tiles, AVX-512 BF16 vectors) gives float64 causal attention
    over the history dequantised by hand, to bf16 rounding; a block out of the store is refused."""
    builds = prompt_builds()
    cache, seqs = with_quantised_history(
        KVShape(1, 2, 64, torch.bfloat16), formats, seed=list(FORMATS).index(formats)
    )
    assert cache.cold is not None
    gen = torch.Generator().manual_seed(6)
    for seq in seqs:
        q_len = min(seq.hot_len, 5)
        query = torch.randn(14, q_len, 64, generator=gen).to(torch.bfloat16)
        keys, values = dequantised_by_hand(cache, seq)  # (KVH, L, D)
        kv_len = keys.shape[1]
        q = query.double().view(2, 7, q_len, 64)
        seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = (q @ keys[:, None].transpose(2, 3) / 8).masked_fill(~seen, float("-inf"))
        expected = (torch.softmax(scores, dim=-1) @ values[:, None]).reshape(14, q_len, 64).transpose(0, 1)
        cold = (
            None if seq.cold_blocks is None else (cache.cold.layer(0), cache.cold.parts(0), seq.cold_blocks)
        )
        for label, kernel in builds:
            got = kernel.prefill_attention(query, cache.keys[0], cache.values[0], seq.kv_slots, 0.125, cold)
            torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2**-7, msg=label)
    outside = (cache.cold.layer(0), cache.cold.parts(0), torch.tensor([99]))
    for _, kernel in builds:
        with pytest.raises(NativeKernelError, match="block"):
            kernel.prefill_attention(query, cache.keys[0], cache.values[0], seqs[0].kv_slots, 0.125, outside)


def tiny_head64() -> LoadedModel:
    """A tiny bf16 Qwen2 with the head size the AMX tiles take (64), two query heads to a KV head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    return LoadedModel(model, tokenizer, "tiny-head64", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("compressed", [False, True])
async def test_the_engine_reads_prompt_chunks_in_place_with_the_logits_of_sdpa(compressed: bool) -> None:
    """bf16, 8-token prompt chunks, the second request reusing the first's cached prefix (so its
    chunks attend to history), teacher-forced, uncompressed or with int8 KV and an 8-token window
    (later chunks see quantised blocks): with an AVX-512 BF16 or AMX build the engine attends
    prompt chunks in place (`prompt_reader`: by tiles where the CPU has them, and by vectors with
    KV_KERNEL=avx512), and every sampled token's logits match those of torch's SDPA over a
    gathered copy (PROMPT_ATTENTION=torch, decodes still in place; and KV_KERNEL=torch, all by
    torch) to two bf16 steps (a quantised block's key offsets left out gives three)."""
    builds = {"auto": f"native-{prompt_builds()[0][0]}"}  # KV_KERNEL -> prompt_reader
    if native_kernel().tiles:
        builds["avx512"] = "native-avx512-bf16"
    tiny = tiny_head64()
    forced = tuple(range(5, 17))

    async def run(kv_kernel: str, prompts: str = "auto") -> list[torch.Tensor]:
        squeeze = {"kv_compression": True, "kv_residual_tokens": 8, "kv_sink_tokens": 0} if compressed else {}
        config = EngineConfig(
            model_path=Path("unused"), dtype="bfloat16", kv_cache_bytes=1 << 22, block_size=8,
            max_tokens_per_step=8, kv_kernel=kv_kernel, prompt_attention=prompts,  # type: ignore[arg-type]
            **squeeze,  # type: ignore[arg-type]
        )  # fmt: skip
        async with Engine(config, tiny) as engine:
            in_place = builds.get(kv_kernel, "torch") if prompts == "auto" else "torch"
            assert engine.stats().prompt_reader == in_place
            assert engine.stats().decode_reader != "torch" or kv_kernel == "torch"
            first = engine.format_chat([{"role": "user", "content": "会议决定下季度增加预算 " * 3}])
            params = SamplingParams(max_new_tokens=12, forced_ids=forced)
            rows = await engine.observe(first, params)
            rows += await engine.observe(first + [7, 8, 9] * 7, params)
            assert engine.stats().prefix_hit_tokens > 0
            return rows

    references = {"PROMPT_ATTENTION=torch": await run("auto", "torch"), "KV_KERNEL=torch": await run("torch")}
    for kv_kernel in builds:
        in_place = await run(kv_kernel)
        for name, sdpa in references.items():
            assert len(in_place) == len(sdpa) == 24
            for got, expected in zip(in_place, sdpa, strict=True):  # logits within ~1: two bf16 steps
                torch.testing.assert_close(got, expected, rtol=0, atol=2**-7, msg=f"{kv_kernel} / {name}")


def test_the_engine_attends_in_place_only_with_a_build_measured_faster_than_torch() -> None:
    """`bench.decode_attention`: the AVX-512 tiles win in both dtypes, the loops the compiler
    vectorises (AVX2, portable) do not; there the engine keeps torch's gathered path."""
    native_kernel()
    expected = {"avx512-bf16": (True, True), "avx2": (False, False), "generic": (False, False)}
    for march, isa in [("native", ""), *runnable_builds()]:
        kernel = kv_native.load(march)
        assert kernel is not None and (not isa or kernel.attention_isa == isa)
        faster = (kernel.attends_faster(torch.bfloat16), kernel.attends_faster(torch.float32))
        assert faster == expected[kernel.attention_isa], march


def test_an_installed_engine_carries_every_file_its_kernels_are_built_from() -> None:
    """The library is compiled from source at start: each C file and every header they include
    must be package data, or an installed engine would fall back to torch without its kernels."""
    root = Path(kv_native.__file__).parent
    config = tomllib.loads((root.parent / "pyproject.toml").read_text())
    shipped = set(config["tool"]["setuptools"]["package-data"]["engine"])
    needed = {source.name for source in kv_native.SOURCES}
    for source in kv_native.SOURCES:
        needed |= set(re.findall(r'#include "([^"]+)"', source.read_text()))
    assert needed <= shipped and all((root / name).is_file() for name in needed)
