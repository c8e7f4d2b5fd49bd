"""The engine's C kernels for reading the KV cache on the CPU, built at start for this CPU.

Three C sources, one library:
- `kv_native.c` reads quantised KV rows in one pass. Torch's eager CPU path reads a (block, KV
  head) row of the quantised store as a gather, a conversion of the codes and a broadcast
  multiply-add, three passes over memory with bf16 arithmetic in between; the kernel gathers,
  converts and applies each row's scale and offset in one pass, and returns what
  `kv_quant.read_rows` returns (to within one bf16 rounding).
- `attention_native.c` is decode attention over the history where it lies in the paged pool
  (full-precision slots and quantised blocks): torch's path (`attention.decode_attention`) first
  gathers every sequence's history into a padded copy. Float32 arithmetic; its results agree with
  torch's to rounding. Its threads are torch's own OpenMP workers (the library links the libgomp
  torch has loaded). bf16 prompt chunks are attended in place too, by AVX-512 BF16 vectors
  (`attention_chunk.h`); on a CPU with AMX its `attention_amx.h` runs bf16 decodes and prompt
  chunks by tiles.
- `layers_native.c` is RMSNorm and SiLU * up in one pass each (`engine.fused`).

The library is compiled when an engine first needs it, with the machine's C compiler (`CC`,
else `cc`) for this CPU (`-march=native`), into a temporary folder that is removed once the
library is loaded: there is no build artefact to go stale when the image moves to another CPU.
A compiler without OpenMP builds it single-threaded. Without a compiler, or if the build fails,
`load()` says why and returns None; the cache then reads with torch (slower on CPU, identical in
result).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_quant import Parts, StoredLayer

# A layer of the quantised store, where its keys' and values' codes lie per KV head, and which of
# its blocks each sequence's history holds (block starts, for decodes).
Cold = tuple[StoredLayer, tuple[Parts, Parts], torch.Tensor, torch.Tensor]
ColdChunk = tuple[StoredLayer, tuple[Parts, Parts], torch.Tensor]

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("kv_native.c", "attention_native.c", "layers_native.c")
)
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp-simd")  # simd: the loops vectorise
OPENMP = "-fopenmp"  # threads from the OpenMP runtime torch has loaded (libgomp.so.1)
DTYPES = (torch.bfloat16, torch.float32)


class ColdLayer(ctypes.Structure):
    """`cold_layer` of attention_native.c: a layer of the quantised store and each sequence's blocks."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("key_codes", "key_scale", "key_offset", "value_codes",
                                                "value_scale", "value_offset")),
        ("kv_heads", ctypes.c_int64),
        ("key_bits", ctypes.c_void_p), ("key_starts", ctypes.c_void_p), ("key_stride", ctypes.c_int64),
        ("value_bits", ctypes.c_void_p), ("value_starts", ctypes.c_void_p), ("value_stride", ctypes.c_int64),
        ("block", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
        ("blocks", ctypes.c_void_p), ("starts", ctypes.c_void_p),
    ]  # fmt: skip


class NativeKernelError(RuntimeError):
    """The kernel was given tensors it cannot read (a bug in the caller, never bad input)."""


@dataclass(frozen=True)
class NativeKernel:
    library: ctypes.CDLL
    isa: str  # "avx512-bf16", "avx2" or "generic": the instruction set the build reads rows with
    attention_isa: str  # "avx512-bf16", "avx2" or "generic": that of decode attention
    tiles: bool = False  # bf16 decode attention by AMX tiles (built for them, and the process may use them)
    layers_isa: str = "loops"  # "avx512-bf16" or "loops": how layers_native.c's element-wise loops run

    def attends_faster(self, dtype: torch.dtype) -> bool:
        """Whether this build's decode attention beats torch's gathered path in `dtype`, as
        `bench.decode_attention` measured it (bench/results/decode-attention-cpu-amx.json, one CPU
        running all three builds): the AVX-512 tiles do, in bf16 (1.2-1.8x) and fp32 (1.4-1.9x),
        over full-precision and quantised history; the loops the compiler vectorises (the AVX2
        and portable builds) run at 0.3-0.5x torch's speed: there torch gathers."""
        return self.attention_isa == "avx512-bf16" and dtype in DTYPES

    @property
    def fuses_mlp(self) -> bool:
        """Whether SiLU * up runs faster here than torch's two operators: the AVX-512 loop does
        (1.2-1.4x in bf16, several times in float32); the loops a compiler makes for older CPUs run
        5-20x slower than torch (`bench.fused_layers`). RMSNorm is faster on every build."""
        return self.layers_isa == "avx512-bf16"

    def decode_isa(self, dtype: torch.dtype, head_dim: int) -> str:
        """What decode attention (over full-precision and quantised history) computes with in
        `dtype`: "amx-bf16" (tiles: bf16, head size a multiple of 64, and at most 16 query heads a
        KV head, as every supported model has), else `attention_isa`."""
        tiled = self.tiles and dtype == torch.bfloat16 and head_dim % 64 == 0
        return "amx-bf16" if tiled else self.attention_isa

    def prompt_isa(self, dtype: torch.dtype, head_dim: int) -> str | None:
        """What prompt chunks are attended with in place (`prefill_attention`), or None where torch
        attends them (SDPA over a gathered copy): "amx-bf16" (tiles) or "avx512-bf16" (the AVX-512
        BF16 build's vectors), in bf16 with a head size that is a multiple of 64."""
        if dtype != torch.bfloat16 or head_dim % 64 or self.attention_isa != "avx512-bf16":
            return None
        return "amx-bf16" if self.tiles else "avx512-bf16"

    def dequantize(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        rows: torch.Tensor,
        bits: int,
        per_token: bool,
    ) -> torch.Tensor:
        """Rows (n,) of codes in one format, dequantised: (n, block, dim) in the scale's dtype.

        codes (R, block, width): int8 centred 8-bit codes or packed 6- or 4-bit ones; scale and offset
        (R, dim) per channel, or (R, block) per token; value = centred code * scale + offset."""
        if codes.dtype != (torch.int8 if bits == 8 else torch.uint8):
            raise NativeKernelError(f"{bits}-bit codes stored as {codes.dtype}")
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in (codes, scale, offset)):
            raise NativeKernelError("the native KV kernel reads contiguous CPU tensors only")
        num_rows, block, width = codes.shape
        dim = width * 8 // bits
        if scale.shape != (num_rows, block if per_token else dim) or offset.shape != scale.shape:
            raise NativeKernelError(f"scale/offset {tuple(scale.shape)} for codes {tuple(codes.shape)}")
        one = Parts(torch.tensor([bits]), torch.tensor([0]), block * width)  # each row a block of one head
        flat = codes.view(num_rows, -1).view(torch.uint8)
        read = self.dequantize_layer
        return read(flat, scale[:, None], offset[:, None], rows, one, per_token, block, dim)

    def dequantize_layer(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        rows: torch.Tensor,
        parts: Parts,
        per_token: bool,
        block: int,
        dim: int,
    ) -> torch.Tensor:
        """Rows (n,) of (block, KV head) of a stored layer, dequantised: (n, block, dim) in the
        scale's dtype. codes (blocks, bytes a block) uint8, each head's in its part's format where
        `parts` says; scale and offset (blocks, KVH, dim) per channel, or (blocks, KVH, block) per
        token; value = centred code * scale + offset."""
        kv_heads = scale.shape[1] if scale.dim() == 3 else 0
        blocks = codes.shape[0]
        if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != parts.stride:
            raise NativeKernelError(
                f"codes {tuple(codes.shape)} {codes.dtype} for {parts.stride} bytes a block"
            )
        if parts.bits.shape != (kv_heads,) or parts.starts.shape != (kv_heads,):
            raise NativeKernelError(f"parts for {parts.bits.shape[0]} heads, scales for {kv_heads}")
        expected = (blocks, kv_heads, block if per_token else dim)
        tensors = (codes, scale, offset, rows, parts.bits, parts.starts)
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise NativeKernelError("the native KV kernel reads contiguous CPU tensors only")
        if scale.shape != expected or offset.shape != expected or rows.dim() != 1:
            raise NativeKernelError(f"scale/offset {tuple(scale.shape)} for codes {tuple(codes.shape)}")
        if scale.dtype not in DTYPES or offset.dtype != scale.dtype or rows.dtype != torch.long:
            raise NativeKernelError(f"unsupported dtypes: {scale.dtype}, {offset.dtype}, {rows.dtype}")
        if parts.bits.dtype != torch.long or parts.starts.dtype != torch.long:
            raise NativeKernelError("parts' bits and starts are int64")
        out = torch.empty(rows.shape[0], block, dim, dtype=scale.dtype)
        status = self.library.kv_dequantize_rows(
            codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), kv_heads, parts.bits.data_ptr(),
            parts.starts.data_ptr(), parts.stride, int(per_token), int(scale.dtype == torch.float32), block,
            dim, blocks * kv_heads, rows.data_ptr(), rows.shape[0], out.data_ptr(),
        )  # fmt: skip
        if status:
            raise NativeKernelError(
                f"rows out of range (of {blocks * kv_heads}) or parts the kernel cannot read"
            )
        return out

    def decode_attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        scale: float,
        cold: Cold | None = None,
    ) -> torch.Tensor:
        """Attention of single-token queries (B, H, D) to their histories in a layer's cache, keys
        and values (S, KVH, D): sequence i's tokens at slots[starts[i]:starts[i + 1]] (long), in
        order; query head kv * (H // KVH) + g attends with KV head kv. Returns (B, H, D).

        `cold`: (the layer of the quantised store, its heads' parts, blocks, block starts): sequence i's
        history begins with the store's blocks[block_starts[i]:block_starts[i + 1]], read where they
        lie (`kv_quant`'s format, never dequantised into a copy).

        With `tiles`, bf16 history is scored and weighed by AMX tiles (quantised blocks first
        dequantised to bf16 rows, as `dequantize` reads them; the probabilities weighed as bf16,
        as torch's gathered path does); `dataclasses.replace(kernel, tiles=False)` keeps the
        AVX-512 path."""
        seqs, heads, dim = query.shape
        kv_heads = keys.shape[1]
        parts = (query, keys, values, slots, starts, *(cold[0] + cold[2:] if cold else ()))
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in parts):
            raise NativeKernelError("the native KV kernel reads contiguous CPU tensors only")
        if keys.shape != values.shape or keys.dim() != 3 or keys.shape[2] != dim or heads % kv_heads:
            shapes = (tuple(t.shape) for t in (keys, values, query))
            raise NativeKernelError("keys {}, values {}, query {}: not one layer's cache".format(*shapes))
        if query.dtype not in DTYPES or keys.dtype != query.dtype or values.dtype != query.dtype:
            raise NativeKernelError(f"unsupported dtypes: {query.dtype}, {keys.dtype}, {values.dtype}")
        if slots.dtype != torch.long or starts.dtype != torch.long or starts.shape != (seqs + 1,):
            raise NativeKernelError(f"slots {slots.dtype}, starts {tuple(starts.shape)} for {seqs} sequences")
        if int(starts[0]) != 0 or int(starts[-1]) != slots.shape[0]:
            raise NativeKernelError("starts must run from 0 to the number of slots")
        layer = None if cold is None else _cold_layer(cold, query, seqs)
        out = torch.empty_like(query)
        status = self.library.kv_decode_attention(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(), starts.data_ptr(), seqs,
            kv_heads, heads // kv_heads, dim, keys.shape[0], scale, int(query.dtype == torch.float32),
            int(self.tiles), None if layer is None else ctypes.byref(layer), out.data_ptr(),
        )  # fmt: skip
        if status:
            raise NativeKernelError(
                f"a slot (of {keys.shape[0]}) or block out of range, or a sequence without a "
                "full-precision token"
            )
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        cold: ColdChunk | None = None,
    ) -> torch.Tensor:
        """Attention of a prompt chunk's bf16 queries (H, q, D) (any strides but the channels') to
        its sequence's tokens at `slots` (n,) of a layer's keys and values (S, KVH, D), the
        chunk's own last, bottom-right causal: of kv tokens in all, its token i sees the first
        kv - q + i + 1. `cold`: (the layer of the quantised store, its heads' parts, blocks (m,)): the
        history begins with those blocks, dequantised to bf16 as `dequantize` reads them. By AMX
        tiles (`tiles`), else by the AVX-512 BF16 build's vectors (head size a multiple of 64 either
        way): scores, a float32 softmax, values weighed with bf16 probabilities, as torch's flash
        attention does. Returns (q, H, D)."""
        heads, q_len, dim = query.shape
        kv_heads = keys.shape[1]
        if self.attention_isa != "avx512-bf16":
            raise NativeKernelError("prompt attention in place needs the AVX-512 BF16 or AMX build")
        if any(t.device.type != "cpu" for t in (query, keys, values, slots)) or query.stride(2) != 1:
            raise NativeKernelError("the native KV kernel reads CPU tensors, channels contiguous")
        if not (keys.is_contiguous() and values.is_contiguous() and slots.is_contiguous()):
            raise NativeKernelError("the native KV kernel reads a contiguous cache and slots")
        if keys.shape != values.shape or keys.dim() != 3 or keys.shape[2] != dim or heads % kv_heads:
            shapes = (tuple(t.shape) for t in (keys, values, query))
            raise NativeKernelError("keys {}, values {}, query {}: not one layer's cache".format(*shapes))
        if {query.dtype, keys.dtype, values.dtype} != {torch.bfloat16} or slots.dtype != torch.long:
            raise NativeKernelError(f"unsupported dtypes: {query.dtype}, {keys.dtype}, {slots.dtype}")
        layer = None
        if cold is not None:
            blocks = cold[2]
            if any(t.device.type != "cpu" or not t.is_contiguous() for t in (*cold[0], blocks)):
                raise NativeKernelError("the native KV kernel reads a contiguous CPU store and blocks")
            starts = torch.tensor([0, blocks.shape[0]], dtype=torch.long)
            layer = _cold_layer((cold[0], cold[1], blocks, starts), query, 1)
        out = torch.empty(q_len, heads, dim, dtype=query.dtype)
        status = self.library.kv_prefill_attention(
            query.data_ptr(), query.stride(0), query.stride(1), keys.data_ptr(), values.data_ptr(),
            slots.data_ptr(), slots.shape[0], q_len, kv_heads, heads // kv_heads, dim, keys.shape[0], scale,
            int(self.tiles), None if layer is None else ctypes.byref(layer), out.data_ptr(),
        )  # fmt: skip
        if status:
            raise NativeKernelError(
                f"{q_len} queries over {slots.shape[0]} tokens (and any quantised blocks) of head size "
                f"{dim}, {heads} heads over {kv_heads}: a slot out of range (of {keys.shape[0]}) or a "
                "block, or a shape the tiles cannot take"
            )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x (..., n) with weight (n,), rounded where transformers' module rounds (see
        layers_native.c): float32 or bfloat16, contiguous, on the CPU."""
        self._elementwise(x, weight)
        if weight.shape != (x.shape[-1],):
            raise NativeKernelError(f"weight {tuple(weight.shape)} for rows of {x.shape[-1]}")
        out = torch.empty_like(x)
        n, fp32 = x.shape[-1], int(x.dtype == torch.float32)
        rows = x.numel() // n
        self.library.kv_rms_norm(x.data_ptr(), weight.data_ptr(), rows, n, eps, fp32, out.data_ptr())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, rounded where torch's eager operators round: float32 or bfloat16."""
        self._elementwise(gate, up)
        if gate.shape != up.shape:
            raise NativeKernelError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        out = torch.empty_like(gate)
        fp32 = int(gate.dtype == torch.float32)
        self.library.kv_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), fp32, out.data_ptr())
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> None:
        """Turns the first `heads` heads of `dim` of each row of x (..., n) in place by the rotary
        embedding, as transformers' `apply_rotary_pos_emb` does and rounds (see layers_native.c);
        cos and sin (..., dim), one row of angles per row of x. float32 or bfloat16, contiguous."""
        self._elementwise(x, cos, sin)
        rows = x.numel() // x.shape[-1]
        if dim % 2 or heads * dim > x.shape[-1]:
            raise NativeKernelError(f"{heads} heads of {dim} in rows of {x.shape[-1]}")
        if cos.shape != sin.shape or cos.shape[-1] != dim or cos.numel() != rows * dim:
            raise NativeKernelError(f"angles {tuple(cos.shape)}, {tuple(sin.shape)} for {rows} rows of {dim}")
        fp32, n = int(x.dtype == torch.float32), x.shape[-1]
        self.library.kv_rotary(x.data_ptr(), rows, n, heads, dim, cos.data_ptr(), sin.data_ptr(), fp32)

    @staticmethod
    def _elementwise(*tensors: torch.Tensor) -> None:
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise NativeKernelError("the native kernels read contiguous CPU tensors only")
        if tensors[0].dtype not in DTYPES or any(t.dtype != tensors[0].dtype for t in tensors):
            raise NativeKernelError(f"unsupported dtypes: {', '.join(str(t.dtype) for t in tensors)}")


def _cold_layer(cold: Cold, query: torch.Tensor, seqs: int) -> ColdLayer:
    stored, (keys, values), blocks, starts = cold
    num_blocks, kv_heads, dim = stored.key_scale.shape
    block = stored.value_scale.shape[2]
    for name, parts in (("key", keys), ("value", values)):
        if (
            parts.bits.shape != (kv_heads,)
            or parts.starts.shape != (kv_heads,)
            or parts.bits.dtype != torch.long
        ):
            raise NativeKernelError(f"{name} parts for {parts.bits.shape} heads, the layer has {kv_heads}")
        if (
            parts.starts.dtype != torch.long
            or parts.bits.device.type != "cpu"
            or parts.starts.device.type != "cpu"
        ):
            raise NativeKernelError(f"{name} parts must be int64 CPU tensors")
    per_channel, per_token = (num_blocks, kv_heads, dim), (num_blocks, kv_heads, block)
    shapes = {"key_codes": (num_blocks, keys.stride), "value_codes": (num_blocks, values.stride),
              "key_scale": per_channel, "key_offset": per_channel, "value_scale": per_token,
              "value_offset": per_token}  # fmt: skip
    if query.shape[2] != dim:
        raise NativeKernelError(f"a query of {query.shape[2]} channels for a store of {dim}")
    for name, shape in shapes.items():
        tensor = getattr(stored, name)
        floating = tensor.dtype.is_floating_point
        if tuple(tensor.shape) != shape or (
            tensor.dtype != query.dtype if floating else tensor.dtype != torch.uint8
        ):
            got = f"{tuple(tensor.shape)} {tensor.dtype}"
            raise NativeKernelError(
                f"{name} {got}, expected {shape} {query.dtype if floating else torch.uint8}"
            )
    if blocks.dtype != torch.long or starts.dtype != torch.long or starts.shape != (seqs + 1,):
        got = f"blocks {blocks.dtype}, block starts {tuple(starts.shape)}"
        raise NativeKernelError(f"{got} for {seqs} sequences")
    if int(starts[0]) != 0 or int(starts[-1]) != blocks.shape[0]:
        raise NativeKernelError("block starts must run from 0 to the number of blocks")
    pointers = (t.data_ptr() for t in stored)
    return ColdLayer(
        *pointers, kv_heads, keys.bits.data_ptr(), keys.starts.data_ptr(), keys.stride,
        values.bits.data_ptr(), values.starts.data_ptr(), values.stride, block, num_blocks, blocks.data_ptr(),
        starts.data_ptr(),
    )  # fmt: skip


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache  # one build per process, target and sources: the library is read-only once loaded
def load(march: str = "native", source_dir: Path | None = None) -> NativeKernel | None:
    """The kernel built for this machine, or None (logged once) where it cannot be built.

    `march` is the compiler's target; the engine always builds for `native` (this CPU). Another
    target (`haswell`: AVX2, `x86-64`: the portable loop) lets a test or a benchmark run the
    paths of a CPU older than this one; a path this CPU lacks would stop the process.
    `source_dir`: where the C files lie, if not beside this module (a benchmark builds an earlier
    revision's)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (CC, cc or gcc) found: quantised KV blocks are read with torch")
        return None
    with tempfile.TemporaryDirectory(prefix="deepanalyze-kv-") as folder:
        target = Path(folder) / "kv_native.so"
        sources = SOURCES if source_dir is None else tuple(source_dir / source.name for source in SOURCES)
        command = [compiler, *FLAGS, f"-march={march}", *map(str, sources), "-o", str(target)]
        try:
            try:
                _build([*command, OPENMP])
            except subprocess.CalledProcessError:  # a compiler without OpenMP: one thread
                _build(command)
                log.warning("the C compiler has no OpenMP: native decode attention runs on one thread")
            library = ctypes.CDLL(str(target))  # mapped now; the file may go with the folder
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the native KV kernel failed (%s): reading with torch", detail)
            return None
    library.kv_native_isa.restype = ctypes.c_char_p
    library.kv_dequantize_rows.restype = ctypes.c_int
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.kv_dequantize_rows.argtypes = [
        pointer, pointer, pointer, i64, pointer, pointer, i64, i32, i32, i64, i64, i64, pointer, i64, pointer,
    ]  # fmt: skip
    library.kv_attention_isa.restype = ctypes.c_char_p
    library.kv_decode_attention.restype = ctypes.c_int
    library.kv_decode_attention.argtypes = [
        pointer, pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, ctypes.c_float, i32, i32,
        ctypes.POINTER(ColdLayer), pointer,
    ]  # fmt: skip
    library.kv_attention_tiles.restype = ctypes.c_int
    library.kv_layers_isa.restype = ctypes.c_char_p
    library.kv_rms_norm.restype = None
    library.kv_rms_norm.argtypes = [pointer, pointer, i64, i64, ctypes.c_float, i32, pointer]
    library.kv_silu_mul.restype = None
    library.kv_silu_mul.argtypes = [pointer, pointer, i64, i32, pointer]
    library.kv_rotary.restype = None
    library.kv_rotary.argtypes = [pointer, i64, i64, i64, i64, pointer, pointer, i32]
    library.kv_prefill_attention.restype = ctypes.c_int
    library.kv_prefill_attention.argtypes = [
        pointer, i64, i64, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64, ctypes.c_float, i32,
        ctypes.POINTER(ColdLayer), pointer,
    ]  # fmt: skip
    return NativeKernel(
        library, library.kv_native_isa().decode(), library.kv_attention_isa().decode(),
        bool(library.kv_attention_tiles()), library.kv_layers_isa().decode(),
    )  # fmt: skip


def _build(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)  # noqa: S603 - our sources
