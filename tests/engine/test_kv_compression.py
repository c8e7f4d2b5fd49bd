"""Quantised KV blocks: round-trip error, exact bytes, attention over mixed blocks, engine parity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, kv_native
from engine.attention import SeqSlice, decode_attention, group_decodes, window_attention
from engine.kv_cache import ColdStore, KVCache, KVShape, slots_of
from engine.kv_native import NativeKernel, NativeKernelError
from engine.kv_policy import heuristic_scores, kernel_target, select_kept, smooth
from engine.kv_quant import (
    LayerFormat,
    QuantFormat,
    centred,
    hadamard,
    head_codes,
    layer_formats,
    part_formats,
    quantize_keys,
    quantize_values,
    unpack,
)
from engine.loader import LoadedModel
from engine.selftest import stock_attention
from engine.tiny import build_tiny


# The format's reference inverse: what every reader (torch, the C kernel) must reproduce.
def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, fmt: QuantFormat
) -> torch.Tensor:
    """codes (..., block_size, KVH, C), scale/min (..., KVH, D) -> keys (..., block_size, KVH, D)."""
    # Computed in fp32 and cast once: on CPU a bf16 multiply-add converts each operand anyway.
    keys = torch.addcmul(low.unsqueeze(-3).float(), unpack(codes, fmt).float(), scale.unsqueeze(-3).float())
    return keys.to(scale.dtype)


def dequantize_values(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, fmt: QuantFormat
) -> torch.Tensor:
    """codes (..., KVH, C), scale/min (..., KVH) -> values (..., KVH, D)."""
    values = unpack(codes, fmt).float().mul_(scale.unsqueeze(-1).float()).add_(low.unsqueeze(-1).float())
    return values.to(scale.dtype)


def outlier_keys(*shape: int) -> torch.Tensor:
    """Random keys with a few large-magnitude channels, as real models have."""
    keys = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    keys[..., 3] = keys[..., 3] * 20 + 50
    return keys


def test_the_rotation_is_orthonormal_symmetric_and_needs_a_power_of_two() -> None:
    h = hadamard(64)
    torch.testing.assert_close(h @ h, torch.eye(64), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T) and set((h.abs() * 8).round().unique().tolist()) == {1.0}
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(24)


def test_the_rotation_spreads_an_outlier_channel_so_4_bit_values_lose_less() -> None:
    """Values are quantised per token over their channels: one large channel sets the step for all
    the others. After the rotation no channel stands out, and the round trip's error is smaller."""
    fmt, h = QuantFormat(4), hadamard(64)
    values = outlier_keys(4, 16, 2, 64)  # channel 3 about 50 + 20x the others

    def error(x: torch.Tensor, rotation: torch.Tensor) -> float:
        back = dequantize_values(*quantize_values(x @ rotation, fmt), fmt) @ rotation
        return float((back - x).pow(2).mean())

    assert error(values, h) < 0.5 * error(values, torch.eye(64))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_round_trip_error_is_within_half_a_step(bits: int) -> None:
    fmt = QuantFormat(bits)
    keys = outlier_keys(5, 16, 2, 64)  # (blocks, block_size, KVH, D)
    codes, scale, low = quantize_keys(keys, fmt)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 16, 2, fmt.code_dim(64))
    assert scale.shape == low.shape == (5, 2, 64)  # per block and channel
    error = (dequantize_keys(codes, scale, low, fmt) - keys).abs()
    assert bool((error <= scale.unsqueeze(1) / 2 + 1e-5).all())
    values = outlier_keys(80, 2, 64)  # (tokens, KVH, D)
    codes, scale, low = quantize_values(values, fmt)
    assert scale.shape == (80, 2)  # per token
    error = (dequantize_values(codes, scale, low, fmt) - values).abs()
    assert bool((error <= scale.unsqueeze(-1) / 2 + 1e-5).all())
    # A constant run is stored exactly.
    flat = torch.full((1, 16, 2, 64), 3.25)
    assert torch.equal(dequantize_keys(*quantize_keys(flat, fmt), fmt), flat)


def test_bytes_per_token_are_exact_for_the_default_models_shape() -> None:
    shape = KVShape(num_layers=24, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)  # Qwen2.5-0.5B
    assert shape.bytes_per_token == 2 * 24 * 2 * 64 * 2
    for bits, ratio in ((8, 148 / 256), (4, 84 / 256)):
        fmt = QuantFormat(bits)
        per_block = ColdStore.bytes_per_block(shape, fmt, 16)
        assert per_block / 16 / shape.bytes_per_token == ratio
        store = ColdStore(shape, fmt, num_blocks=3, block_size=16, device=torch.device("cpu"))
        assert store.total_bytes == 3 * per_block


@pytest.mark.parametrize(("bits", "tolerance"), [(8, 0.02), (6, 0.05), (4, 0.15)])
def test_attention_over_quantised_blocks_stays_close(bits: int, tolerance: float) -> None:
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    size, hot_blocks = 8, 8
    cache = KVCache(
        shape,
        hot_blocks,
        size,
        torch.device("cpu"),
        ColdStore(shape, QuantFormat(bits), 4, size, torch.device("cpu")),
    )
    gen = torch.Generator().manual_seed(1)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    table = [0, 1, 2, 3, 4]  # 37 tokens: block 0 stays (sink), blocks 1-3 go cold, block 4 is recent
    length = 37
    query = torch.randn(4, 2, 16, generator=gen)  # (H, T, D): two sequences' decode queries
    hot_only = SeqSlice(0, 1, slots_of(table, length, size))
    reference = decode_attention(
        query, cache, 0, group_decodes([hot_only], 2, size, cache.keys.device)[0], 0.25
    )

    cache.settle(torch.tensor([1, 2, 3]), torch.tensor([8, 9, 10]))  # pool ids of the cold blocks
    mixed_table = [0, 8, 9, 10, 4]
    slots = slots_of(mixed_table, length, size)
    mixed = SeqSlice(0, 1, slots[slots < hot_blocks * size], torch.tensor([0, 1, 2]), 3 * size)
    other = SeqSlice(1, 1, slots_of([5], 6, size))  # a shorter, uncompressed neighbour in the group
    groups = group_decodes([mixed, other], 2, size, cache.keys.device, spread=100.0)
    assert len(groups) == 1 and groups[0].padding is not None
    out = decode_attention(query, cache, 0, groups[0], 0.25)
    row = int((groups[0].rows == 0).nonzero())
    error = (out[row] - reference[0]).abs().max() / reference[0].abs().max()
    assert float(error) < tolerance
    # The prompt-chunk path reads the same keys (quantised first, then full precision).
    key, _ = cache.read(0, mixed.kv_slots, mixed.cold_blocks)
    full, _ = cache.read(0, hot_only.kv_slots)
    assert key.shape == full.shape == (1, 2, length, 16)


def test_centred_codes_are_the_codes_minus_the_middle_one() -> None:
    for bits in (8, 4):
        fmt = QuantFormat(bits)
        codes = torch.arange(fmt.levels + 1, dtype=torch.uint8).repeat(2)[None, :]  # (1, 2 * levels)
        packed = (
            codes if bits == 8 else codes[:, : codes.shape[1] // 2] | (codes[:, codes.shape[1] // 2 :] << 4)
        )
        assert torch.equal(centred(packed, fmt).long(), codes.long() - fmt.zero)


def test_six_bit_codes_lie_where_the_layout_says_and_read_back_centred_on_32() -> None:
    """6-bit codes of D channels take 3 D / 4 bytes: byte d < D / 2 holds the low nibbles of
    channels d (low) and d + D / 2 (high), byte D / 2 + j the top two bits of channels j, j + D / 4,
    j + D / 2 and j + 3 D / 4, from its low bits up; unpacked here by hand, byte by byte."""
    fmt, dim = QuantFormat(6), 16
    codes = torch.randint(0, 64, (3, dim), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    codes[:, 0], codes[:, 1] = 0, 63  # each row's range: 63 steps of 1 from 0
    values = codes.float()[:, None, :]  # one token of each of 3 rows, per-token scale 1, min 0
    packed, scale, low = quantize_values(values, fmt)
    assert torch.equal(scale.float(), torch.ones(3, 1)) and not low.any() and packed.shape == (3, 1, 12)
    for row in range(3):
        stored = packed[row, 0].tolist()
        for d in range(dim):
            nibble = stored[d % 8] >> (4 * (d >= 8)) & 15
            top = stored[8 + d % 4] >> (2 * (d // 4)) & 3
            assert nibble | top << 4 == codes[row, d]
    assert torch.equal(centred(packed, fmt).long(), codes[:, None, :].long() - 32)


def native_kernel() -> NativeKernel:
    """The C kernel; a machine with a C compiler that cannot build it is a failure, not a skip."""
    if kv_native._compiler() is None:
        pytest.skip("no C compiler: the native KV kernel cannot be built here")
    kernel = kv_native.load()
    assert kernel is not None, "a C compiler is present, yet the native KV kernel did not build"
    return kernel


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("reader", ["torch", "native"])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_reading_stored_blocks_gives_what_dequantising_the_codes_gives(
    bits: int, reader: str, rotate: bool
) -> None:
    """The store keeps 8-bit codes centred and offsets (min + zero * scale) in place of the
    minimums; reading any (block, KV head) rows, with torch or the C kernel, must still give the
    keys and values the quantised codes stand for. Rotated: the codes are those of the keys and
    values times the Hadamard matrix H, and what is read is their dequantisation times H again."""
    kernel = native_kernel() if reader == "native" else None
    shape, size, fmt = KVShape(2, 2, 32, torch.float32), 16, QuantFormat(bits)
    store = ColdStore(shape, fmt, 6, size, torch.device("cpu"), kernel, rotate=rotate)
    h = hadamard(32) if rotate else torch.eye(32)
    stored = head_codes(store.layer(1).key_codes, store.formats[1], 1, False, 32)  # (blocks, bs, C)
    assert stored.dtype == fmt.storage_dtype and stored.shape == (6, size, fmt.code_dim(32))
    assert store.reader == ("torch" if kernel is None else f"native-{kernel.isa}")
    blocks = outlier_keys(2, 2, 6, size, 2, 32)  # keys/values, (L, n, bs, KVH, D)
    store.store(blocks[0], blocks[1], torch.arange(6))
    rows = torch.tensor([11, 0, 5, 5, 2])  # (block, KV head) rows, in any order, repeats allowed
    history = store.gathered(1, rows, pairs=5)  # one row per "pair": (5, bs, D)
    expected_keys = dequantize_keys(*quantize_keys(blocks[0, 1] @ h, fmt), fmt) @ h  # (n, bs, KVH, D)
    expected_values = dequantize_values(*quantize_values(blocks[1, 1] @ h, fmt), fmt) @ h
    for i, row in enumerate(rows.tolist()):
        block, head = divmod(row, 2)
        torch.testing.assert_close(history.keys[i], expected_keys[block, :, head], rtol=0, atol=1e-4)
        torch.testing.assert_close(history.values[i], expected_values[block, :, head], rtol=0, atol=1e-4)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("reader", ["torch", "native"])
def test_a_store_of_mixed_formats_reads_each_layer_and_part_in_its_own(reader: str, rotate: bool) -> None:
    """Layers 0 and 2 at 4 bits, layer 1 at 8 (KV_INT8_LAYERS), layer 3 at 6 (KV_INT6_LAYERS), layer
    4 with each KV head's keys and values in a format of their own (KV_INT6_PARTS): every (block,
    KV head) reads back what dequantising its own part's codes gives, and the bytes are each
    part's format's."""
    kernel = native_kernel() if reader == "native" else None
    shape, size = KVShape(5, 2, 32, torch.float32), 16
    parts = LayerFormat((QuantFormat(8), QuantFormat(6)), (QuantFormat(4), QuantFormat(6)))
    formats = (QuantFormat(4), QuantFormat(8), QuantFormat(4), QuantFormat(6), parts)
    store = ColdStore(shape, formats, 4, size, torch.device("cpu"), kernel, rotate=rotate)
    h = hadamard(32) if rotate else torch.eye(32)
    blocks = outlier_keys(2, 5, 4, size, 2, 32)  # keys/values, (L, n, bs, KVH, D)
    store.store(blocks[0], blocks[1], torch.tensor([2, 0, 3, 1]))  # into blocks out of order
    rows = torch.tensor([0, 7, 3, 4, 5])  # (block, KV head) rows
    for layer, fmt in enumerate(store.formats):
        history = store.gathered(layer, rows, pairs=5)
        for i, row in enumerate(rows.tolist()):
            block, head = divmod(row, 2)
            source = [2, 0, 3, 1].index(block)
            key_fmt, value_fmt = fmt.keys[head], fmt.values[head]
            key = blocks[0, layer, source, :, head : head + 1] @ h  # (bs, 1, D): one head's block
            value = blocks[1, layer, source, :, head : head + 1] @ h
            keys = dequantize_keys(*quantize_keys(key, key_fmt), key_fmt) @ h
            values = dequantize_values(*quantize_values(value, value_fmt), value_fmt) @ h
            torch.testing.assert_close(history.keys[i], keys[:, 0], rtol=0, atol=1e-4)
            torch.testing.assert_close(history.values[i], values[:, 0], rtol=0, atol=1e-4)
    assert store.formats[1] == LayerFormat.uniform(QuantFormat(8), 2) and store.formats[4] == parts
    per_layer = [ColdStore.bytes_per_block(KVShape(1, 2, 32, torch.float32), (f,), size) for f in formats]
    assert ColdStore.bytes_per_block(shape, formats, size) == sum(per_layer)
    assert store.total_bytes == 4 * sum(per_layer)
    # the parts' layer: keys 32 + 24 bytes a token, values 16 + 24, and each head's scales
    assert per_layer[4] == size * (32 + 24 + 16 + 24) + 2 * (2 * size + 2 * 32) * 4
    assert store.lowest_bits == 4


def test_int8_layers_are_named_from_zero_once_each_and_within_the_model() -> None:
    config = EngineConfig(model_path=Path("unused"), kv_int8_layers="21, 9,13")  # type: ignore[arg-type]
    assert config.kv_int8_layers == (9, 13, 21)
    for wrong, why in (("1,1", "each named once"), ((-1,), "each named once"), ("-1", "separated by commas")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(model_path=Path("unused"), kv_int8_layers=wrong)  # type: ignore[arg-type]
    assert [f.bits for f in layer_formats(3, 4, (1,))] == [4, 8, 4]
    with pytest.raises(ValueError, match="names layers \\[3\\]; the model has 3"):
        layer_formats(3, 4, (0, 3))
    config = EngineConfig(model_path=Path("unused"), kv_int6_layers="2,0")  # type: ignore[arg-type]
    assert config.kv_int6_layers == (0, 2)
    assert [f.bits for f in layer_formats(4, 4, (1,), config.kv_int6_layers)] == [6, 8, 6, 4]
    with pytest.raises(ValueError, match="KV_INT6_LAYERS names layers \\[4\\]"):
        layer_formats(4, 4, (), (4,))
    with pytest.raises(ValueError, match="layers \\[1\\] are named both"):
        layer_formats(4, 4, (1,), (1, 2))


def test_int6_parts_are_a_layer_a_head_and_keys_or_values_each_named_once() -> None:
    config = EngineConfig(model_path=Path("unused"), kv_int6_parts="11.1.v, 2.0.k,11.0.k")  # type: ignore[arg-type]
    assert config.kv_int6_parts == ("2.0.k", "11.0.k", "11.1.v")
    assert config.int6_parts == {(2, 0, False): 6, (11, 0, False): 6, (11, 1, True): 6}
    for wrong, why in (("1.0.k,1.0.k", "named once"), ("1.0.q", "layer.head.k"), ("1,2", "layer.head.k")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(model_path=Path("unused"), kv_int6_parts=wrong)  # type: ignore[arg-type]
    formats = part_formats(layer_formats(3, 4, (2,)), 2, {(0, 1, True): 6, (2, 0, False): 6})
    assert formats[0] == LayerFormat((QuantFormat(4),) * 2, (QuantFormat(4), QuantFormat(6)))
    assert formats[1] == LayerFormat.uniform(QuantFormat(4), 2)
    assert formats[2] == LayerFormat((QuantFormat(6), QuantFormat(8)), (QuantFormat(8),) * 2)
    with pytest.raises(ValueError, match="outside the model's 3 layers x 2 KV heads"):
        part_formats(layer_formats(3, 4), 2, {(0, 2, True): 6})


@pytest.mark.parametrize("head_dim", [64, 24])  # 24: not a multiple of the vector width (portable loop)
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_the_native_kernel_reads_bf16_blocks_as_torch_does(bits: int, head_dim: int) -> None:
    """bf16 store, every row read once and some twice: the kernel's one fused multiply-add
    rounds once, torch's bf16 multiply-add may round differently by one bf16 step at most."""
    kernel = native_kernel()
    shape, size, fmt = KVShape(1, 2, head_dim, torch.bfloat16), 16, QuantFormat(bits)
    stores = [ColdStore(shape, fmt, 8, size, torch.device("cpu"), k) for k in (None, kernel)]
    blocks = (outlier_keys(2, 1, 8, size, 2, head_dim) * 0.1).to(torch.bfloat16)
    for store in stores:
        store.store(blocks[0], blocks[1], torch.arange(8))
    rows = torch.cat((torch.randperm(16, generator=torch.Generator().manual_seed(2)), torch.tensor([3, 3])))
    by_torch, by_kernel = (store.gathered(0, rows, pairs=2) for store in stores)
    for got, expected in ((by_kernel.keys, by_torch.keys), (by_kernel.values, by_torch.values)):
        assert got.dtype == torch.bfloat16 and got.shape == (2, 9 * size, head_dim)
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)


def runnable_builds() -> list[tuple[str, str]]:
    """(compiler target, the read path it builds) for every build of the kernel this CPU can run
    besides its own: on x86, the portable and AVX2 paths of older CPUs (KV_KERNEL=portable, avx2)."""
    builds = []
    for choice, isa in (("portable", "generic"), ("avx2", "avx2")):
        try:
            builds.append((kernel_target(choice), isa))  # type: ignore[arg-type]
        except ValueError:  # this CPU lacks the path
            continue
    return builds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: AVX2 reads 8-bit rows 8 wide, the rest loop
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_every_build_of_the_native_kernel_reads_what_dequantising_by_hand_gives(
    bits: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Rows gathered out of order, repeated, from a store of random codes, scales and offsets: each
    build this CPU can run (its own, and the AVX2 and portable paths it also runs) gives
    centred code * scale + offset, computed here in fp32 and rounded once to the store's dtype
    (one fused multiply-add in the kernel: bf16 results may differ by one bf16 step)."""
    native_kernel()  # skips without a compiler
    gen = torch.Generator().manual_seed(bits + head_dim)
    rows_total, block, width = 9, 16, head_dim * bits // 8
    codes = torch.randint(0, 256, (rows_total, block, width), generator=gen, dtype=torch.uint8)
    if bits == 8:
        codes = codes.view(torch.int8)
    rows = torch.tensor([4, 0, 8, 4, 2, 7])
    for per_token in (False, True):
        params = (rows_total, block if per_token else head_dim)
        scale = (torch.rand(params, generator=gen) * 0.1).to(dtype)
        offset = torch.randn(params, generator=gen).to(dtype)
        # 8-bit codes are stored centred; 4- and 6-bit ones packed (the 6-bit layout by hand: above)
        centred_codes = (codes if bits == 8 else centred(codes, QuantFormat(bits))).float()[rows]
        s, b = (p.float()[rows].unsqueeze(2 if per_token else 1) for p in (scale, offset))
        expected = (centred_codes * s + b).to(dtype)
        for march, isa in [("native", ""), *runnable_builds()]:
            kernel = kv_native.load(march)
            assert kernel is not None, f"the kernel did not build for -march={march}"
            assert not isa or kernel.isa == isa
            got = kernel.dequantize(codes, scale, offset, rows, bits, per_token)
            assert got.dtype == dtype and got.shape == (6, block, head_dim)
            step = 2**-7 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(got, expected, rtol=step, atol=1e-6, msg=f"{march} ({kernel.isa})")


def test_every_build_rounds_bf16_halfway_values_to_even_as_torch_does() -> None:
    """1 + k/256 lies halfway between two bf16 neighbours for odd k: read as centred code k with a
    scale of 1/256 and an offset of 1, every build must give torch's rounding, to the bit."""
    native_kernel()
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(16, 1)[None].repeat(1, 1, 4)  # (1, 16, 64)
    scale, offset = torch.full((1, 16), 2**-8, dtype=torch.bfloat16), torch.ones(1, 16, dtype=torch.bfloat16)
    expected = (codes[0].float() * 2**-8 + 1).to(torch.bfloat16)
    for march, _ in [("native", ""), *runnable_builds()]:
        kernel = kv_native.load(march)
        assert kernel is not None
        got = kernel.dequantize(codes, scale, offset, torch.tensor([0]), 8, per_token=True)[0]
        assert torch.equal(got, expected), f"{march} ({kernel.isa})"


def test_the_native_kernel_refuses_what_it_cannot_read() -> None:
    kernel = native_kernel()
    codes = torch.zeros(4, 16, 8, dtype=torch.int8)  # 4 rows of 16 tokens, 8 channels
    scale = offset = torch.ones(4, 8)
    read = kernel.dequantize(codes, scale, offset, torch.tensor([3, 0]), 8, per_token=False)
    assert read.shape == (2, 16, 8)
    with pytest.raises(NativeKernelError, match="out of range"):
        kernel.dequantize(codes, scale, offset, torch.tensor([4]), 8, per_token=False)
    with pytest.raises(NativeKernelError, match="out of range"):
        kernel.dequantize(codes, scale, offset, torch.tensor([-1]), 8, per_token=False)
    with pytest.raises(NativeKernelError, match="scale/offset"):  # per token: (4, 16) expected
        kernel.dequantize(codes, scale, offset, torch.tensor([0]), 8, per_token=True)
    with pytest.raises(NativeKernelError, match="4-bit codes"):
        kernel.dequantize(codes, scale, offset, torch.tensor([0]), 4, per_token=False)
    with pytest.raises(NativeKernelError, match="contiguous"):
        kernel.dequantize(codes, scale.t().contiguous().t(), offset, torch.tensor([0]), 8, per_token=False)


@pytest.mark.parametrize("reader", ["torch", "native"])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_bf16_decode_attention_over_long_quantised_histories_matches_fp32(bits: int, reader: str) -> None:
    """bf16 cache, two sequences of 12 cold blocks, read by torch or the C kernel: against fp32
    attention over the same dequantised keys and values. Long histories average values towards
    zero, where bf16 rounding of the quantised parts would show."""
    kernel = native_kernel() if reader == "native" else None
    shape, size, fmt = KVShape(1, 2, 32, torch.bfloat16), 16, QuantFormat(bits)
    store = ColdStore(shape, fmt, 24, size, torch.device("cpu"), kernel)
    cache = KVCache(shape, 4, size, torch.device("cpu"), store)
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randn(2, 1, 24, size, 2, 32, generator=gen).to(torch.bfloat16)  # keys, values
    cache.cold.store(blocks[0], blocks[1], torch.arange(24))
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    seqs = [SeqSlice(i, 1, slots_of([i], 8, size), torch.arange(12) + 12 * i, 12 * size) for i in range(2)]
    group = group_decodes(seqs, 2, size, torch.device("cpu"))[0]
    query = torch.randn(4, 2, 32, generator=gen).to(torch.bfloat16)
    out = decode_attention(query, cache, 0, group, 32**-0.5).float()
    for seq in seqs:
        cold = torch.arange(12) + 12 * seq.q_start
        codes, scale, low = quantize_keys(blocks[0, 0, cold].float(), fmt)
        keys = torch.cat(
            (dequantize_keys(codes, scale, low, fmt).flatten(0, 1), cache.keys[0, seq.kv_slots].float())
        )
        codes, scale, low = quantize_values(blocks[1, 0, cold].float(), fmt)
        values = torch.cat(
            (dequantize_values(codes, scale, low, fmt).flatten(0, 1), cache.values[0, seq.kv_slots].float())
        )
        q = query[:, seq.q_start].float().view(2, 2, 32)  # (KVH, G, D)
        probs = torch.softmax(q @ keys.permute(1, 2, 0) * 32**-0.5, dim=-1)  # (KVH, G, L)
        reference = (probs @ values.transpose(0, 1)).reshape(4, 32)
        row = int((group.rows == seq.q_start).nonzero())
        # bf16 rounding of the history and of the products alone reaches ~2 % of the largest output
        # on some draws (any bits); a misread code is off by whole steps
        assert float((out[row] - reference).abs().max()) < 0.03 * float(reference.abs().max())


@pytest.fixture(scope="module")
def tiny(test_device: torch.device) -> LoadedModel:
    return build_tiny("qwen2", device=test_device)


def watch_ratios(engine: Engine, ratios: list[float]) -> asyncio.Task[None]:
    """A task recording the pool's bytes-held ratio at every turn of the loop until cancelled."""

    async def watch() -> None:
        while True:
            if (stats := engine.stats()).kv_tokens:
                ratios.append(stats.kv_ratio)
            await asyncio.sleep(0)

    return asyncio.create_task(watch())


async def run(tiny: LoadedModel, **options: object) -> tuple[list[list[int]], list[float]]:
    config = EngineConfig(
        model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, dynamic_batching=True,
        max_batch_size=5, block_size=4, max_tokens_per_step=16, prefix_caching=False, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    engine = Engine(config, tiny)
    ratios: list[float] = []
    async with engine:
        ids = [
            engine.format_chat([{"role": "user", "content": f"document {i}: " + "late fee " * 8}])
            for i in range(5)
        ]

        watcher = watch_ratios(engine, ratios)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        results = await asyncio.gather(*(engine.generate(i, params) for i in ids))
        watcher.cancel()
        assert engine.stats().kv_used_bytes == 0, "every block, full precision and quantised, returned"
    return [r.token_ids for r in results], ratios


@pytest.mark.parametrize("rotate", [False, True])
async def test_compressed_engine_holds_fewer_bytes_and_agrees_with_uncompressed(
    tiny: LoadedModel, rotate: bool
) -> None:
    """With or without the Hadamard rotation (same bytes: the rotation is not stored)."""
    plain, plain_ratios = await run(tiny)
    assert min(plain_ratios) >= 1.0  # whole blocks, allocated a step ahead: never less than a token's worth
    options = {"kv_compression": True, "kv_quant_bits": 8, "kv_residual_tokens": 8, "kv_rotate": rotate}
    int8, ratios = await run(tiny, **options)
    # tiny model in fp32 with 16-dim heads: a quantised int8 token takes 288 of 512 bytes
    assert min(ratios) < 0.75
    agree = sum(a == b for x, y in zip(plain, int8, strict=True) for a, b in zip(x, y, strict=True))
    assert agree / sum(map(len, plain)) >= 0.95


async def test_with_no_window_and_no_sink_only_the_block_being_written_stays_full_precision(
    tiny: LoadedModel,
) -> None:
    """KV_RESIDUAL_TOKENS=0 KV_SINK_TOKENS=0: every full block is quantised at the next step, so
    fewer bytes are held than with a window and a sink, and int8 still agrees with uncompressed."""
    plain, _ = await run(tiny)
    base = {"kv_compression": True, "kv_quant_bits": 8}
    _, with_window = await run(tiny, **base, kv_residual_tokens=8, kv_sink_tokens=4)
    bare, without = await run(tiny, **base, kv_residual_tokens=0, kv_sink_tokens=0)
    assert min(without) < min(with_window)
    agree = sum(a == b for x, y in zip(plain, bare, strict=True) for a, b in zip(x, y, strict=True))
    assert agree / sum(map(len, plain)) >= 0.95


@pytest.mark.parametrize("bits", [8, 6, 4])
async def test_the_native_and_torch_readers_generate_the_same_tokens(tiny: LoadedModel, bits: int) -> None:
    """On CPU the engine reads quantised blocks with the C kernel unless told otherwise; both
    readers give the same fp32 values to rounding, so greedy decoding must not fork."""
    if tiny.device.type != "cpu":
        pytest.skip("the native reader is for CPU caches")
    kernel = native_kernel()
    config = EngineConfig(
        model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, kv_compression=True
    )
    assert Engine(config, tiny).stats().kv_reader == f"native-{kernel.isa}"
    options = {"kv_compression": True, "kv_quant_bits": bits, "kv_residual_tokens": 8}
    native, _ = await run(tiny, **options)
    by_torch, _ = await run(tiny, **options, kv_kernel="torch")
    assert native == by_torch


@pytest.mark.parametrize("choice", ["avx2", "portable"])
async def test_an_older_cpus_kernel_path_is_chosen_by_name_and_generates_the_same_tokens(
    tiny: LoadedModel, choice: str
) -> None:
    """KV_KERNEL=avx2 or portable builds the kernel for an older CPU's path (to measure it here):
    the engine says which reader it runs and decodes what torch's reader decodes; a CPU without
    the path refuses the choice at start instead of stopping on an illegal instruction."""
    if tiny.device.type != "cpu":
        pytest.skip("the native reader is for CPU caches")
    native_kernel()
    try:
        kernel_target(choice)  # type: ignore[arg-type]
    except ValueError as refused:
        with pytest.raises(ValueError, match=f"KV_KERNEL={choice} needs"):
            await run(tiny, kv_compression=True, kv_kernel=choice)
        pytest.skip(str(refused))
    config = EngineConfig(
        model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, kv_compression=True,
        kv_kernel=choice,  # type: ignore[arg-type]
    )  # fmt: skip
    assert Engine(config, tiny).stats().kv_reader == ("native-avx2" if choice == "avx2" else "native-generic")
    options = {"kv_compression": True, "kv_quant_bits": 4, "kv_residual_tokens": 8}
    older, _ = await run(tiny, **options, kv_kernel=choice)
    by_torch, _ = await run(tiny, **options, kv_kernel="torch")
    assert older == by_torch


async def test_int4_with_every_layer_named_int8_or_int6_is_that_profile_token_for_token(
    tiny: LoadedModel,
) -> None:
    """KV_INT8_LAYERS (KV_INT6_LAYERS) over all layers stores and reads exactly what KV_QUANT_BITS=8
    (6) does; naming one layer holds bytes between int4's and int8's (int6's), each layer in its
    format."""
    layers = int(tiny.model.config.num_hidden_layers)
    base: dict[str, object] = {"kv_compression": True, "kv_residual_tokens": 8}
    int8, _ = await run(tiny, **base, kv_quant_bits=8)
    every, _ = await run(tiny, **base, kv_quant_bits=4, kv_int8_layers=tuple(range(layers)))
    assert every == int8
    int6, _ = await run(tiny, **base, kv_quant_bits=6)
    every6, _ = await run(tiny, **base, kv_quant_bits=4, kv_int6_layers=tuple(range(layers)))
    assert every6 == int6
    heads = int(tiny.model.config.num_key_value_heads)
    named = ",".join(
        f"{layer}.{head}.{kind}" for layer in range(layers) for head in range(heads) for kind in "kv"
    )
    every_part, _ = await run(tiny, **base, kv_quant_bits=4, kv_int6_parts=named)
    assert every_part == int6

    def cold_bytes(**options: object) -> float:
        config = EngineConfig(
            model_path=Path("unused"),
            dtype="float32",
            kv_cache_bytes=1 << 22,
            **base,
            **options,  # type: ignore[arg-type]
        )
        return Engine(config, tiny).stats().kv_cold_bytes_per_token

    four, six, eight, one, one6 = (
        cold_bytes(kv_quant_bits=4),
        cold_bytes(kv_quant_bits=6),
        cold_bytes(kv_quant_bits=8),
        cold_bytes(kv_quant_bits=4, kv_int8_layers=(0,)),
        cold_bytes(kv_quant_bits=4, kv_int6_layers=(0,)),
    )
    assert one == pytest.approx(four + (eight - four) / layers)
    assert one6 == pytest.approx(four + (six - four) / layers) and four < six < eight
    part = cold_bytes(kv_quant_bits=4, kv_int6_parts="0.0.v")  # one head's values of one layer
    heads = int(tiny.model.config.num_key_value_heads)
    assert part == pytest.approx(four + (six - four) / layers / heads / 2)


async def test_status_reports_compression(tiny: LoadedModel) -> None:
    config = EngineConfig(
        model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, kv_compression=True
    )
    stats = Engine(config, tiny).stats()
    assert stats.kv_quant_bits == 8  # the default profile
    assert 0 < stats.kv_cold_bytes_per_token < stats.kv_bytes_per_token


def test_pruning_keeps_sinks_window_and_the_top_scored_exactly() -> None:
    scores = torch.tensor([0.0, 0, 5, 1, 9, 1, 7, 0, 0, 0])  # 10 tokens
    kept = select_kept(scores, keep_ratio=0.6, sinks=2, window=2)  # 6 tokens: 2 + 2 + best 2
    assert kept.tolist() == [0, 1, 4, 6, 8, 9]
    ties = select_kept(torch.ones(10), keep_ratio=0.5, sinks=1, window=1)
    assert ties.tolist() == [0, 6, 7, 8, 9]  # ties go to later tokens
    assert select_kept(scores, keep_ratio=0.1, sinks=4, window=4).tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert select_kept(scores, keep_ratio=1.0, sinks=0, window=1).tolist() == list(range(10))
    assert smooth(torch.tensor([0.0, 0, 3, 0, 0]), kernel=3).tolist() == [0, 3, 3, 3, 0]


def test_the_articles_heuristic_scores_punctuation_function_words_and_repeats_zero() -> None:
    words = {1: "The", 2: " fee", 3: "，", 4: "的", 5: " wrong", 6: "!"}
    scores = heuristic_scores([1, 2, 3, 4, 5, 2, 5, 2, 5, 6], lambda t: words[t])
    # the bigrams at 4-5 (" wrong", " fee") and 5-6 (" fee", " wrong") come again at 6-7 and 7-8
    assert scores.tolist() == [0, 1, 0, 0, 1, 1, 1, 0, 0, 0]


def test_window_attention_sums_each_keys_share_of_the_last_queries() -> None:
    gen = torch.Generator().manual_seed(3)
    query, key = (
        torch.randn(4, 6, 8, generator=gen),
        torch.randn(2, 6, 8, generator=gen),
    )  # 4 heads, 2 KV heads
    got = window_attention(query, key, window=2, scale=0.5)
    expected = torch.zeros(6)
    for head in range(4):
        for i in (4, 5):  # the last two tokens, each attending to itself and before
            weights = torch.softmax(query[head, i] @ key[head // 2, : i + 1].T * 0.5, dim=-1)
            expected[: i + 1] += weights
    assert torch.allclose(got, expected, atol=1e-5)
    assert float(got.sum()) == pytest.approx(8.0)  # 4 heads x 2 queries, each distributing 1


@torch.inference_mode()
def recompute_pruned(loaded: LoadedModel, ids: list[int], kept: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation where every generated token's query sees only the
    kept prompt tokens and the generated ones (the prompt itself was read in full)."""
    seq, prompt = list(ids), len(ids)
    with stock_attention(loaded):
        for _ in range(n):
            size = len(seq)
            allowed = torch.ones(size, size, dtype=torch.bool, device=loaded.device).tril()
            visible = torch.zeros(size, dtype=torch.bool, device=loaded.device)
            visible[kept] = True
            allowed[prompt:, :prompt] &= visible[:prompt]
            logits = loaded.model(
                torch.tensor([seq], device=loaded.device), attention_mask=allowed[None, None]
            ).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[prompt:]


async def test_pruned_engine_matches_recomputation_that_masks_the_dropped_tokens(tiny: LoadedModel) -> None:
    """Pruning is exact: kept tokens' keys and values (positions unchanged) are what the dropped
    ones' absence leaves. The heuristic policy makes the kept set computable here."""
    options = {"kv_compression": True, "kv_quant_bits": 16, "kv_keep_ratio": 0.5, "kv_sink_tokens": 4}
    outputs, ratios = await run(tiny, **options, kv_prune_policy="heuristic", kv_observe_tokens=8)
    assert min(ratios) < 0.75  # about half of each prompt is gone
    engine = Engine(EngineConfig(model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22), tiny)
    for i, output in enumerate(outputs):
        ids = engine.format_chat([{"role": "user", "content": f"document {i}: " + "late fee " * 8}])
        scores = heuristic_scores(ids, lambda t: engine.decode([t]))
        kept = select_kept(scores, 0.5, sinks=4, window=8).tolist()
        assert len(kept) < len(ids)
        assert output == recompute_pruned(tiny, ids, kept, len(output))


async def test_attention_pruning_with_int4_blocks_holds_a_fraction_of_the_bytes(tiny: LoadedModel) -> None:
    options = {"kv_compression": True, "kv_quant_bits": 4, "kv_keep_ratio": 0.5, "kv_observe_tokens": 8}
    outputs, ratios = await run(tiny, **options, kv_residual_tokens=4)
    assert all(len(o) == 24 for o in outputs)
    # fp32 tiny model: int4 blocks take 224 of 512 bytes a token; half the prompt is gone
    assert min(ratios) < 0.4


async def test_a_prompt_read_in_full_precision_ends_as_uncompressed_then_decodes_over_quantised_blocks(
    tiny: LoadedModel,
) -> None:
    """KV_PROMPT_TOKENS: a prompt of several steps' chunks is read over its full-precision
    history, so the logits at its end (where labels are scored and the first token sampled) are
    the uncompressed engine's exactly; without it the chunks after the first read quantised blocks
    and the end differs. Decoding reads quantised blocks either way: later rows differ, and the
    pool holds fewer bytes than uncompressed once the sequence decodes."""
    prompt_text = "the refund was promised twice and never came; " * 6

    async def rows(**options: object) -> tuple[list[torch.Tensor], float]:
        config = EngineConfig(
            model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 22, block_size=4,
            max_tokens_per_step=16, prefix_caching=False, **options,  # type: ignore[arg-type]
        )  # fmt: skip
        ratios: list[float] = []
        async with Engine(config, tiny) as engine:
            ids = engine.format_chat([{"role": "user", "content": prompt_text}])
            assert len(ids) > 3 * config.max_tokens_per_step
            watcher = watch_ratios(engine, ratios)
            observed = await engine.observe(ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
            watcher.cancel()
        return observed, min(ratios)

    int4 = {"kv_compression": True, "kv_quant_bits": 4, "kv_residual_tokens": 0, "kv_sink_tokens": 0}
    plain, _ = await rows()
    quantised, _ = await rows(**int4)
    read_whole, ratio = await rows(**int4, kv_prompt_tokens=256)
    assert torch.equal(read_whole[0], plain[0])
    assert not torch.equal(quantised[0], plain[0])
    assert any(not torch.equal(a, b) for a, b in zip(read_whole[1:], plain[1:], strict=True))
    assert ratio < 0.6
