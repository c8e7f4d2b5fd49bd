"""Which linear-weight format to build next on a CPU: the model's own products timed in each
format, and what each format does to the model's next-token distributions, in minutes.

On this project's CPUs the weights' products are most of a step (`bench.engine_profile`: 72 % in
fp32 on an AVX2 EPYC), so the format the weights are multiplied in bounds the engine's speed.

Speed: one decoder layer's linear shapes (q, k, v, o, gate, up, down) at each of `--rows` rows (1:
a lone decode; 32: a decode step's batch; 192: a prompt chunk; 512), every format in each of
`--rounds` rounds, formats alternating; per format the median round: ms per layer and GFLOP/s.
`--layers N` times a pass through N layers of distinct weights instead of one: with one layer
the weights stay in the CPU's caches from pass to pass, with the model's count (24) each product
reads them from memory, as an engine step does.

Formats, in fp32 activations but the last two:
- `plain`: `nn.Linear` as transformers builds it (torch's default CPU path);
- `packed`: `engine.linear.PackedLinear`, the weight reordered once for oneDNN (what the engine runs);
- `int8`: weights int8 per output channel, activations quantised at run time (torch's dynamic
  quantised Linear, fbgemm/x86, which torch has deprecated; llama.cpp's Q8_0 is the analogue). Its
  activation scale is one per call, so a row's product depends on the other rows of its batch:
  the engine's outputs would no longer be independent of what it batches;
- `int8-row`: the same weights, each activation row quantised with a scale of its own (as
  llama.cpp's Q8_0 activations are), multiplied by `torch._int_mm` (int8 x int8 -> int32) and
  rescaled: independent of the batch, but torch's integer product has no fast CPU kernel (on an
  AVX2 EPYC, 236 ms a layer at 1 row against 3.7 ms packed): it shows the error such a format
  makes, and its speed would need a kernel of the engine's own;
- `int8-g128`, `int8-g32`: weights and activations in int8 with a scale per group of 128 (32, as
  llama.cpp's Q8_0 x Q8_0) consecutive input channels, per output channel and per row: the
  formats whose error an outlier channel spreads over its group only. Quality only, not timed:
  no CPU kernel here multiplies them (on a CPU without VNNI each group's int32 sum needs a
  conversion and a scaled float add per output, work the size of the fp32 product it replaces);
- `plain-bf16`, `packed-bf16`: `plain` and `packed` with bf16 weights and activations, what the
  engine multiplies in on a CPU with native bf16 (speed only: `--docs 0`, or they are left out of
  the quality part).

Every int8 format's quality is computed from its codes dequantised in fp32: the numbers an integer
kernel gives, up to the fp32 rounding of the sum (an integer product of whole documents through
`torch._int_mm` takes minutes a document here).

Quality: on `--docs` evenly spaced documents of bench/data/kv-corpus.jsonl (the documents the KV
benchmarks use), the narrative prompt followed by the plain model's greedy continuation
(`--tf-tokens`), read in one forward by the model in each format: mean next-token KL over the
whole vocabulary against `plain`, over the continuation's positions, and top-1 agreement. The
decoder layers' linears and the output head are converted, as the engine packs them.

    python -m bench.linear_formats --docs 8 --out bench/results/linear-formats-cpu.json
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from bench import common
from engine.linear import PackedLinear, can_pack, linear_targets

FORMATS = ("plain", "packed", "int8", "int8-row", "int8-g128", "int8-g32", "plain-bf16", "packed-bf16")
UNTIMED = ("int8-g128", "int8-g32")  # no kernel: quality only


def int8_linear(linear: nn.Linear) -> nn.Module:
    """`linear` with int8 weights (symmetric, a scale per output channel), fp32 in and out."""
    weight = linear.weight.detach().float()
    scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates its quantised tensors: a reference here, no more
        warnings.simplefilter("ignore", UserWarning)
        quantised = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        module = torch.ao.nn.quantized.dynamic.Linear(linear.in_features, linear.out_features)
        bias = None if linear.bias is None else linear.bias.detach().float()
        module.set_weight_bias(quantised, bias)
    return module


class RowInt8Linear(nn.Module):
    """int8 weights (a scale per output channel) times int8 activations (a scale per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # (out,)
        self.codes_t = torch.round(weight / self.scales[:, None]).to(torch.int8).t().contiguous()  # (in, out)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        row_scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127  # (n, 1)
        codes = torch.round(rows / row_scales).to(torch.int8)
        # torch's integer product wants more than 16 rows: pad a decode's few rows with zeros.
        padded = torch.nn.functional.pad(codes, (0, 0, 0, max(0, 17 - codes.shape[0])))
        out = torch._int_mm(padded, self.codes_t)[: codes.shape[0]].float() * row_scales * self.scales
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1)


def fake_int8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """`x` rounded to symmetric int8 codes with a scale per `group` consecutive elements of its last
    dimension (None: the whole of it), and dequantised."""
    size = group or x.shape[-1]
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    scales = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
    return (torch.round(grouped / scales) * scales).reshape(x.shape)


class DequantisedInt8Linear(nn.Module):
    """The product an int8 x int8 kernel with a scale per `group` input channels (None: per output
    channel and per row) computes, from the dequantised codes in fp32."""

    def __init__(self, linear: nn.Linear, group: int | None) -> None:
        super().__init__()
        if group is not None and linear.in_features % group:
            raise ValueError(f"{linear.in_features} input channels do not split into groups of {group}")
        self.group = group
        self.weight = fake_int8(linear.weight.detach().float(), group)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(fake_int8(x.float(), self.group), self.weight, self.bias)


CONVERT: dict[str, Callable[[nn.Linear], nn.Module]] = {  # what is timed
    "plain": lambda linear: linear,
    "packed": PackedLinear,
    "int8": int8_linear,
    "int8-row": RowInt8Linear,
    # bf16 weights and activations (speed only): what the engine multiplies in on a bf16 CPU
    "plain-bf16": lambda linear: copy.deepcopy(linear).to(torch.bfloat16),
    "packed-bf16": lambda linear: PackedLinear(copy.deepcopy(linear).to(torch.bfloat16)),
}
BF16 = frozenset({"plain-bf16", "packed-bf16"})
QUALITY: dict[str, Callable[[nn.Linear], nn.Module]] = CONVERT | {  # what reads the documents
    "int8-row": lambda linear: DequantisedInt8Linear(linear, None),
    "int8-g128": lambda linear: DequantisedInt8Linear(linear, 128),
    "int8-g32": lambda linear: DequantisedInt8Linear(linear, 32),
}


def convert(
    model: nn.Module, fmt: str, table: dict[str, Callable[[nn.Linear], nn.Module]] = CONVERT
) -> nn.Module:
    """A copy of `model` whose decoder-layer linears and output head are in `fmt` (as `table` builds it)."""
    if fmt == "plain":
        return model
    out = copy.deepcopy(model)
    for parent, name in linear_targets(out):
        setattr(parent, name, table[fmt](getattr(parent, name)))
    return out


def layer_shapes(config: Any) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears: q, k, v, o, gate, up, down."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        (hidden, q),
        (hidden, kv),
        (hidden, kv),
        (q, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]


def time_layer(modules: list[nn.Module], inputs: list[torch.Tensor], budget_s: float = 1.0) -> float:
    """Seconds for one pass over a layer's linears (the mean of as many passes as fit the budget)."""
    with torch.inference_mode():
        for module, x in zip(modules, inputs, strict=True):
            module(x)
        passes, began = 0, time.perf_counter()
        while passes < 3 or time.perf_counter() - began < budget_s:
            for module, x in zip(modules, inputs, strict=True):
                module(x)
            passes += 1
    return (time.perf_counter() - began) / passes


def speed(
    config: Any, formats: list[str], rows: list[int], rounds: int, console: Console, layers: int = 1
) -> list[dict[str, Any]]:
    """Per format and row count: ms per layer over a pass through `layers` layers of distinct
    weights (1: one layer's, which stay in the CPU's caches from pass to pass; the model's layer
    count: every product reads its weights from memory, as in an engine step)."""
    torch.manual_seed(0)
    shapes = layer_shapes(config)
    plain = [nn.Linear(i, o) for _ in range(layers) for i, o in shapes]
    modules = {fmt: [CONVERT[fmt](linear) for linear in plain] for fmt in formats}
    results = []
    for n in rows:
        one_layer = [torch.randn(n, i) for i, _ in shapes]
        inputs, bf16_inputs = one_layer * layers, [x.to(torch.bfloat16) for x in one_layer] * layers
        flops = sum(2 * n * i * o for i, o in shapes)
        seconds: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for round_ in range(rounds):
            order = formats[round_ % len(formats) :] + formats[: round_ % len(formats)]
            for fmt in order:
                seconds[fmt].append(time_layer(modules[fmt], bf16_inputs if fmt in BF16 else inputs) / layers)
        for fmt in formats:
            s = statistics.median(seconds[fmt])
            results.append({"format": fmt, "rows": n, "ms_per_layer": s * 1e3, "gflop_s": flops / s / 1e9,
                            "rounds_ms": [x * 1e3 for x in seconds[fmt]]})  # fmt: skip
        console.print(
            f"{n} rows: "
            + ", ".join(f"{r['format']} {r['ms_per_layer']:.2f} ms" for r in results[-len(formats) :])
        )
    return results


def quality(model: nn.Module, tokenizer: Any, formats: list[str], docs: list[dict[str, Any]], tf_tokens: int,
            console: Console) -> list[dict[str, Any]]:  # fmt: skip
    from bench.kv_formats import continuations

    seqs = continuations(model, tokenizer, docs, tf_tokens)

    def logprobs(m: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            logits = m(ids[None]).logits[0, n - 1 : -1].float()  # the continuation's positions
        return torch.log_softmax(logits, dim=-1)

    reference = [logprobs(model, ids, n) for ids, n in seqs]
    results = []
    for fmt in formats:
        if fmt == "plain" or fmt in BF16:
            continue
        converted, began = convert(model, fmt, QUALITY), time.perf_counter()
        kls, top1 = [], []
        for (ids, n), ref in zip(seqs, reference, strict=True):
            test = logprobs(converted, ids, n)
            kls.append(float((ref.exp() * (ref - test)).sum(-1).mean()))
            top1.append(float((ref.argmax(-1) == test.argmax(-1)).float().mean()))
        results.append({"format": fmt, "kl_mean": statistics.mean(kls), "kl": kls, "top1": statistics.mean(top1),
                        "seconds": time.perf_counter() - began})  # fmt: skip
        console.print(f"{fmt}: KL {results[-1]['kl_mean']:.5f}, top-1 {results[-1]['top1']:.4f}")
        del converted
    return results


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--formats", default=",".join(f for f in FORMATS if f not in BF16), help="default: fp32 ones"
    )
    parser.add_argument("--rows", default="1,32,192,512", help="rows per product (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--layers", type=int, default=1,
        help="layers of distinct weights per timed pass (1: cache-resident; the model's 24: read from memory)",
    )  # fmt: skip
    parser.add_argument("--docs", type=int, default=8, help="evenly spaced documents (0: speed only)")
    parser.add_argument("--tf-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/linear-formats.json"))
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from bench.kv_quality import load_corpus

    console = Console(width=140)
    args.model = common.model_path(args.model)
    formats = common.names(parser, args.formats, FORMATS)
    if "packed" in formats and not can_pack(torch.device("cpu"), torch.float32):
        parser.error("this torch cannot pack fp32 weights for oneDNN here: leave out `packed`")
    if "packed-bf16" in formats and not can_pack(torch.device("cpu"), torch.bfloat16):
        parser.error("this CPU has no native bf16 for oneDNN: leave out `packed-bf16`")
    config = AutoConfig.from_pretrained(args.model)
    timed = [fmt for fmt in formats if fmt not in UNTIMED]
    timings = speed(config, timed, [int(r) for r in args.rows.split(",")], args.rounds, console, args.layers)
    accuracy: list[dict[str, Any]] = []
    docs = load_corpus(args.docs) if args.docs else []
    if docs:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model: Any = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="sdpa"
        )
        model.eval()
        accuracy = quality(model, tokenizer, formats, docs, args.tf_tokens, console)
    table = Table("format", *(f"{n} rows: ms/layer (GFLOP/s)" for n in sorted({t["rows"] for t in timings})),
                  "KL vs plain", "top-1 = plain",
                  title=f"linear formats, {torch.get_num_threads()} threads")  # fmt: skip
    for fmt in formats:
        cells = [f"{t['ms_per_layer']:.2f} ({t['gflop_s']:.0f})" for t in timings if t["format"] == fmt]
        cells = cells or ["not timed"] * len({t["rows"] for t in timings})
        acc = next((a for a in accuracy if a["format"] == fmt), None)
        table.add_row(
            fmt, *cells, f"{acc['kl_mean']:.5f}" if acc else "–", f"{acc['top1']:.4f}" if acc else "–"
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": common.machine() | {"threads": torch.get_num_threads(), "platform": platform.platform(),
                                       "torch": torch.__version__},
        "config": {k: str(v) for k, v in vars(args).items()},
        "documents": [d["document_id"] for d in docs],
        "speed": timings, "quality": accuracy,
    }, indent=1, ensure_ascii=False))  # fmt: skip
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
