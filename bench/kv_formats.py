"""Which quantised KV format to build next: formats tried by fake quantisation, KL only, in minutes.

`bench.kv_quality` measures a profile the engine runs, with analyses, on the whole corpus: hours on
this CPU. This program answers a narrower question fast: how much does a candidate format disturb
the model's next-token distributions? On evenly spaced documents of bench/data/kv-corpus.jsonl the
model (transformers, bf16 unless --dtype says otherwise) reads the narrative prompt in 192-token
chunks and then teacher-forces its own greedy continuation (--tf-tokens) in 16-token steps; after
every step the blocks the engine would have moved to cold storage (whole 16-token blocks past the sink blocks, older than the
residual window) are quantised and dequantised in place, once each, with the engine's own
`quantize_keys` / `quantize_values` (keys per channel over a block, values per token). Every
format's logits are compared with the same run unquantised: mean next-token KL over the whole
vocabulary and top-1 agreement. `floor` reads the prompt in 128-token chunks instead, unquantised:
what rounding alone gives, the bar's reference.

A format sets bits for keys and values (8, 4, or none: full precision) per layer, optional
Hadamard rotation of keys and/or values before quantising, the residual window, the sink blocks,
and optionally a value range chosen by least squared error instead of min-max (`value_clips`: not
yet a quantiser the engine has; the same bytes), or keys quantised before rotary embedding
(`pre_rope_keys`: turned back by the model's rotary angles first; not yet a store the engine has,
the same bytes), or 4-bit codes indexing 16 levels fitted per layer to this model's keys and values
(`codebook`: Lloyd-Max on `--calibration-docs` corpus documents the evaluation does not use, a
group's min and max kept exact; not yet a store the engine has, the same bytes), or, per KV head,
the key channels that carry most of the scores' expected error at 8 bits (`hot_keys`: a channel's
mean squared query times its mean squared range over a block, on the same calibration documents;
keys are quantised per channel, so a channel's bits are its own) and the value channels that weigh
most in the output kept at full precision, the rest quantised per token over their own range
(`hot_values`; neither is a store the engine has yet, both cost bytes, counted), or, per block and
KV head, a few elements that set their groups' ranges kept exact beside the codes (`sparse_keys`,
`sparse_values`: KVQuant's dense-and-sparse, the outliers chosen greedily per block; not a store the
engine has yet, each kept element counted as a value and a 16-bit position), or keys quantised per
token over their (rotated) channels as values are (`keys_per_token`, QuaRot's layout: a scale and an
offset per token instead of per channel, counted; `channel_key_layers` left per channel). Bytes per token
are given twice: the cold blocks' exact bytes (codes, scales, offsets) over bf16's, and "counted"
as `bench.kv_quality` counts a sequence's blocks at its last step (the sink blocks, the window and
the block being written at full precision; median over the documents, prompt and continuation).
No engine kernel is exercised: a format found here is built, then measured by `bench.kv_quality`.

    python -m bench.kv_formats --docs 12 --out bench/results/kv-formats-cpu.json
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from bench.kv_calibration import (
    Channels,
    calibrate,
    calibration_documents,
    choose_channels,
    round_trip_errors,
)
from bench.kv_fake import Codebooks, Format, HotChannels, bytes_ratio, counted_ratio, head_size, logprobs
from engine.config import kv_part
from engine.loader import select_dtype

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)

# The most sensitive layers of the 0.5B default (one layer quantised to int4 at a time, 6 documents:
# 16, 11, 9, 13, 21 raise KL most; the rest sit at the floor).
SENSITIVE = (9, 11, 13, 16, 21)

# int4, but int8 in the sensitive layers: the engine's KV_QUANT_BITS=4 KV_INT8_LAYERS=9,11,13,16,21
MIXED = Format(layer_bits={layer: (8, 8) for layer in SENSITIVE})

# The same bytes spent as 6 bits in ten layers (`python -m bench.kv_heads --alloc 4,6@layer`: each
# part's 4-bit cost from the sweep, modelled to quarter with each bit, allocated a layer at a time):
# about half int4+int8@5's error. The engine's KV_QUANT_BITS=4 KV_INT6_LAYERS=9,11,13,14,15,16,20,21,22,23
SIX_BIT_LAYERS = (9, 11, 13, 14, 15, 16, 20, 21, 22, 23)
MIXED6 = Format(layer_bits={layer: (6, 6) for layer in SIX_BIT_LAYERS})

# The same bytes as 6 bits in forty parts (layer, KV head, keys or values), allocated a part at a time
# (`python -m bench.kv_heads --alloc 4,6` over kv-heads-cpu-24docs-bf16.json's sweep): about half
# int4+int8@5's error in the search. The engine's KV_QUANT_BITS=4 KV_INT6_PARTS=<these, as 16.0.k>.
SIX_BIT_PARTS = (
    "3.0.v", "7.1.v", "9.1.k", "9.1.v", "10.1.k", "10.1.v", "11.0.k", "11.0.v", "11.1.k", "11.1.v", "13.0.k",
    "13.0.v", "13.1.k", "13.1.v", "14.0.k", "14.0.v", "14.1.k", "14.1.v", "15.1.k", "15.1.v", "16.0.k", "16.0.v",
    "16.1.k", "16.1.v", "17.1.k", "17.1.v", "19.0.k", "19.0.v", "20.1.k", "20.1.v", "21.0.k", "21.0.v", "21.1.k",
    "21.1.v", "22.0.k", "22.0.v", "22.1.k", "22.1.v", "23.1.k", "23.1.v",
)  # fmt: skip

# The same bytes allocated over costs swept along the service's answers instead (`python -m
# bench.kv_heads --sweep-along analysis --calibration-docs 16 --calibration-real 8 --sweep-dtype
# bfloat16 --sweep-tokens 96 --alloc 4,6`, kv-heads-cpu-analysis-sweep-bf16.json: 24 documents none
# of the evaluations read, the engine's JSON answers forced 96 tokens).
SIX_BIT_PARTS_ANSWERS = (
    "0.0.k", "0.0.v", "0.1.k", "0.1.v", "1.0.k", "1.0.v", "1.1.k", "1.1.v", "2.0.k", "2.0.v", "2.1.k", "2.1.v",
    "3.0.k", "3.0.v", "3.1.v", "4.1.v", "5.0.k", "5.0.v", "6.0.v", "7.1.k", "7.1.v", "9.1.k", "9.1.v", "10.1.k",
    "11.0.k", "11.0.v", "11.1.k", "11.1.v", "13.0.k", "13.0.v", "13.1.k", "13.1.v", "14.1.k", "14.1.v", "16.0.k",
    "16.0.v", "16.1.k", "20.1.k", "21.0.k", "22.1.k",
)  # fmt: skip


def parts_format(parts: tuple[str, ...], kv_heads: int = 2) -> Format:
    """int4 with `parts` ("layer.head.k" or "layer.head.v") at 6 bits, as KV_INT6_PARTS stores them."""
    named = set(map(kv_part, parts))
    layers = {layer for layer, _, _ in named}
    return Format(
        head_bits={
            (layer, head): (
                6 if (layer, head, False) in named else 4,
                6 if (layer, head, True) in named else 4,
            )
            for layer in layers
            for head in range(kv_heads)
        }
    )


MIXED6_PARTS = parts_format(SIX_BIT_PARTS)

FORMATS: dict[str, Format] = {
    "floor": Format(quantise=False, prompt_chunk=128),
    "int8": Format(key_bits=8, value_bits=8),
    "int4": Format(),
    "int4-rot": Format(rotate_keys=True, rotate_values=True),
    "int4-rot-values": Format(rotate_values=True),
    "k4-only": Format(value_bits=None),
    "v4-only": Format(key_bits=None),
    "k8v4": Format(key_bits=8),
    "int4-window64": Format(residual=64),
    "int4+int8@3layers": Format(layer_bits={layer: (8, 8) for layer in (9, 11, 16)}),
    "int4+int8@5layers": MIXED,
    "int4+k8@5layers": Format(layer_bits={layer: (8, 4) for layer in SENSITIVE}),
    "int4+k8@5layers+v8@2": Format(
        layer_bits={layer: (8, 8) if layer in (11, 16) else (8, 4) for layer in SENSITIVE}
    ),
    # Key scales over 32 or 64 tokens instead of 16: a fifth of int4's key bytes are scales.
    "int4-keys32": Format(key_blocks=2),
    "int4-keys64": Format(key_blocks=4),
    "int4+int8@5layers-keys32": replace(MIXED, key_blocks=2),
    "int4+k8@5layers+v8@2-keys32": Format(
        layer_bits={layer: (8, 8) if layer in (11, 16) else (8, 4) for layer in SENSITIVE}, key_blocks=2
    ),
    # 32-token key scales only where int4 costs little; the sensitive layers int8 with 16-token ones.
    "int4-keys32+int8@5layers": replace(MIXED, key_blocks=2, layer_key_blocks=dict.fromkeys(SENSITIVE, 1)),
    # What the engine holds at full precision besides cold blocks: the sink block, the window, the
    # block being written (~0.04 of the bytes at ~1,000-token documents). Shorter windows, no sink.
    "int4+int8@5layers-w16": replace(MIXED, residual=16),
    "int4+int8@5layers-w0": replace(MIXED, residual=0),
    "int4+int6@10layers-w0": replace(MIXED6, residual=0),
    "int4+int6@40parts-w0": replace(MIXED6_PARTS, residual=0),
    "int4+int8@5layers-nosink": replace(MIXED, sink_blocks=0),
    "int4+int8@5layers-w0-nosink": replace(MIXED, residual=0, sink_blocks=0),
    "int4-w0-nosink": Format(residual=0, sink_blocks=0),
    # A better quantiser at the same bytes: the value range chosen by least squared error.
    "int4+int8@5layers-w0-vclip": replace(MIXED, residual=0, value_clips=CLIPS),
    "int4+int8@5layers-w0-nosink-vclip": replace(MIXED, residual=0, sink_blocks=0, value_clips=CLIPS),
    # Keys quantised before rotary embedding: a key channel pair turns with position after it, which
    # widens each channel's range over a block; before it, a channel's outliers stay in that channel.
    "int4-prerope": Format(pre_rope_keys=True),
    "int4+int8@5layers-w0-prerope": replace(MIXED, residual=0, pre_rope_keys=True),
    "int4+int8@5layers-w0-nosink-prerope": replace(MIXED, residual=0, sink_blocks=0, pre_rope_keys=True),
    # Non-uniform 4-bit levels (KVQuant's nuq idea), fitted per layer: int4 alone, and the profile.
    "int4-codebook": Format(codebook=True),
    "int4+int8@5layers-w0-codebook": replace(MIXED, residual=0, codebook=True),
    # The keys' bits where the query looks: 8 or 16 channels of 64 per KV head at 8 bits, chosen per
    # layer by query energy x range (calibration documents), the rest at 4; values 4 bits, or 8 in
    # the sensitive layers.
    "int4-hot8": Format(hot_keys=8),
    "int4-hot16": Format(hot_keys=16),
    "int4-hot8-w0": Format(hot_keys=8, residual=0),
    "int4-hot16-w0": Format(hot_keys=16, residual=0),
    "int4-hot8+v8@5layers-w0": Format(
        hot_keys=8, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE}
    ),
    "int4-hot12+v8@5layers-w0": Format(
        hot_keys=12, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE}
    ),
    "int4-hot16+v8@4layers-w0": Format(
        hot_keys=16, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE[1:]}
    ),
    "int4+int8@5layers-w0-hot8": replace(MIXED, residual=0, hot_keys=8),
    "int4-hot16pooled-w0": Format(hot_keys=16, hot_keys_pooled=True, residual=0),
    "int4-hot16pooled-v2-w0": Format(hot_keys=16, hot_keys_pooled=True, hot_values=2, residual=0),
    "int4-hot16-v2-w0": Format(hot_keys=16, hot_values=2, residual=0),
    "int4-hot16-v4-w0": Format(hot_keys=16, hot_values=4, residual=0),
    "int4-v4-w0": Format(hot_values=4, residual=0),
    "int4-hot16+v8@2layers-v2-w0": Format(
        hot_keys=16, hot_values=2, residual=0, layer_bits={layer: (4, 8) for layer in (11, 16)}
    ),
    # Dense-and-sparse: per block and KV head, the elements that set their groups' ranges kept exact
    # (KVQuant's 1 % outliers; 8 of a block's 1,024 keys or values per KV head cost 0.008x).
    "int4-w0": Format(residual=0),
    "int4-w0-s4": Format(residual=0, sparse_keys=4, sparse_values=4),
    "int4-w0-sk8": Format(residual=0, sparse_keys=8),
    "int4-w0-sv8": Format(residual=0, sparse_values=8),
    "int4+int8@4layers-w0-s8": Format(
        residual=0, sparse_keys=8, sparse_values=8, layer_bits={layer: (8, 8) for layer in (9, 11, 13, 16)}
    ),
    "int4+int8@4layers-w0-s4": Format(
        residual=0, sparse_keys=4, sparse_values=4, layer_bits={layer: (8, 8) for layer in (9, 11, 13, 16)}
    ),
    "int4-hot16-w0-sv8": Format(hot_keys=16, residual=0, sparse_values=8),
    "int4-hot16-w0-sv16": Format(hot_keys=16, residual=0, sparse_values=16),
    # Which half the best of them leaves its error in: its keys alone, its values alone.
    "int4-hot16-w0-keys-only": Format(hot_keys=16, residual=0, value_bits=None),
    "int4-w0-sv16-values-only": Format(key_bits=None, residual=0, sparse_values=16),
    "int4-w0-s8": Format(residual=0, sparse_keys=8, sparse_values=8),
    "int4-w0-s16": Format(residual=0, sparse_keys=16, sparse_values=16),
    "int4-w0-s24": Format(residual=0, sparse_keys=24, sparse_values=24),
    "int4-w0-sk24": Format(residual=0, sparse_keys=24),
    "int4-w0-sv24": Format(residual=0, sparse_values=24),
    "int4-w0-sk32-sv16": Format(residual=0, sparse_keys=32, sparse_values=16),
    # Keys per token over their channels, as values are (a 4-byte scale and offset per token instead
    # of 16 bytes of per-channel scales per token): 6-bit key codes at about int4's bytes, with the
    # Hadamard rotation that spreads outlier channels over a token's group.
    "k6tok-rot+v4-w0": Format(key_bits=6, keys_per_token=True, rotate_keys=True, residual=0),
    # Layer 0's keys per channel all the same: its key bias (up to ~145) sets a token's range there.
    "k6tok-rot+v4rot-w0-ch0": Format(
        key_bits=6,
        keys_per_token=True,
        channel_key_layers=(0,),
        rotate_keys=True,
        rotate_values=True,
        residual=0,
    ),
    "k6tok+v4-w0-ch0": Format(key_bits=6, keys_per_token=True, channel_key_layers=(0,), residual=0),
    "int4+int8@2layers-w0-s16": Format(
        residual=0, sparse_keys=16, sparse_values=16, layer_bits={layer: (8, 8) for layer in (11, 16)}
    ),
}

# Levels of a 4-bit codebook, per layer: (keys', values'), each (16,) ascending in [0, 1] (0 and 1


@dataclass
class Result:
    format: str
    bytes_ratio: float
    counted_ratio: float  # median over the documents: sink, window and the block being written too
    kl_mean: float
    kl_per_doc: list[float]
    top1: float
    seconds: float
    spec: dict[str, Any]


def prompt_ids(tokenizer: Any, doc: dict[str, Any]) -> torch.Tensor:
    """The document's narrative prompt, as the engine would read it."""
    from prompts import render
    from schemas import BUILT_IN_KINDS, Language, Polarity

    polarity = Polarity(doc.get("label_polarity", "neutral"))
    messages = render(BUILT_IN_KINDS[doc["kind"]], Language(doc["language"]), doc["text"], polarity).messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def continuations(
    model: Any, tokenizer: Any, docs: list[dict[str, Any]], tokens: int
) -> list[tuple[torch.Tensor, int]]:
    """Each document's narrative prompt followed by the model's greedy continuation."""
    out = []
    for doc in docs:
        prompt = prompt_ids(tokenizer, doc)
        with torch.inference_mode():
            ids = model.generate(prompt[None], max_new_tokens=tokens, do_sample=False)[0]
        out.append((ids, len(prompt)))
    return out


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    parser.add_argument("--docs", type=int, default=12, help="evenly spaced documents of the corpus")
    parser.add_argument("--tf-tokens", type=int, default=128)
    parser.add_argument(
        "--calibration-docs", type=int, default=6,
        help="corpus documents (none of the evaluated ones) the codebook formats' levels are fitted on",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-formats.json"))
    parser.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float32"), default="bfloat16",
        help="the model's and the cache's; auto: the engine's choice (fp32 on a CPU without native bf16, "
        "where bf16 products are several times slower)",
    )  # fmt: skip
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.kv_quality import load_corpus

    console = Console(width=140)
    args.model = common.model_path(args.model)
    names = common.names(parser, args.formats, FORMATS)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.dtype = str(select_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    model: Any = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    )
    model.eval()
    docs = load_corpus(args.docs)
    seqs = continuations(model, tokenizer, docs, args.tf_tokens)
    reference = [logprobs(model, ids, n, Format(quantise=False)) for ids, n in seqs]
    fitted = calibration_documents(docs, args.calibration_docs)
    calibration = [(p, len(p)) for p in (prompt_ids(tokenizer, d) for d in fitted)]
    formats = [FORMATS[name] for name in names]
    if any(f.codebook or f.hot_keys or f.hot_values for f in formats):
        console.print(f"calibration documents: {[d['document_id'] for d in fitted]}")
    codebooks, errors = None, None
    if any(f.codebook for f in formats):
        codebooks = calibrate(model, calibration)
        errors = round_trip_errors(model, seqs, codebooks)
        console.print("4-bit round trip, squared error on the evaluated prompts, codebook / uniform: " + ", ".join(
            f"{part} {errors[f'{part} codebook'] / errors[f'{part} uniform']:.3f}" for part in ("keys", "values")))  # fmt: skip
    channels = choose_channels(model, calibration, formats)
    for choice, per_layer in channels.key_shares.items():
        flat = [share for heads in per_layer.values() for share in heads]
        console.print(
            f"{choice} hot key channels carry {min(flat):.2f}-{max(flat):.2f} of a head's key weight"
        )
    layers = model.config.num_hidden_layers
    head_dim = head_size(model.config)
    kv_heads = int(model.config.num_key_value_heads)
    results = []
    for name in names:
        fmt, began = FORMATS[name], time.perf_counter()
        kls, top1 = [], []
        for (ids, n), ref in zip(seqs, reference, strict=True):
            test = logprobs(
                model, ids, n, fmt, codebooks, channels.keys.get(fmt.hot_key_choice()), channels.values.get(fmt.hot_values)
            )  # fmt: skip
            kls.append(float((ref.exp() * (ref - test)).sum(-1).mean()))
            # the token greedy decoding would pick is one the reference would pick too (ties count)
            picked = ref.gather(-1, test.argmax(-1, keepdim=True))
            top1.append(float((picked == ref.amax(-1, keepdim=True)).float().mean()))
        cold = bytes_ratio(fmt, layers, head_dim, kv_heads=kv_heads)
        counted = statistics.median(
            counted_ratio(fmt, layers, head_dim, len(ids), kv_heads) for ids, _ in seqs
        )
        results.append(Result(name, cold, counted, statistics.mean(kls), kls, statistics.mean(top1),
                              time.perf_counter() - began, settings(fmt)))  # fmt: skip
        console.print(f"{name}: KL {results[-1].kl_mean:.5f}, bytes {results[-1].bytes_ratio:.3f} cold, "
                      f"{counted:.3f} counted")  # fmt: skip
        write(args, docs, results, codebooks, errors, channels)
    table = Table("format", "cold bytes/token vs bf16", "counted", "KL mean", "top-1", "s",
                  title=f"KV formats by fake quantisation, {len(docs)} documents x {args.tf_tokens} tokens")  # fmt: skip
    for r in results:
        table.add_row(
            r.format,
            f"{r.bytes_ratio:.3f}",
            f"{r.counted_ratio:.3f}",
            f"{r.kl_mean:.5f}",
            f"{r.top1:.4f}",
            f"{r.seconds:.0f}",
        )
    console.print(table)
    console.print(f"wrote {args.out}")


def settings(fmt: Format) -> dict[str, Any]:
    """A format's fields as JSON holds them: per-head bits keyed "layer.head"."""
    fields = asdict(fmt)
    fields["head_bits"] = {f"{layer}.{head}": bits for (layer, head), bits in fmt.head_bits.items()}
    return fields


def write(
    args: Any, docs: list[dict[str, Any]], results: list[Result], codebooks: Codebooks | None = None,
    errors: dict[str, float] | None = None, channels: Channels | None = None,
) -> None:  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "documents": [d["document_id"] for d in docs],
        "results": [asdict(r) for r in results],
        "codebooks": {layer: {"keys": k.tolist(), "values": v.tolist()} for layer, (k, v) in (codebooks or {}).items()},
        "round_trip_errors": errors,
        "hot_key_channels": _channel_lists(channels.keys if channels else None),
        "hot_value_channels": _channel_lists(channels.values if channels else None),
        "hot_key_weight_shares": channels.key_shares if channels else None,
    }, indent=1, ensure_ascii=False, default=str))  # fmt: skip


def _channel_lists(chosen: dict[Any, HotChannels] | None) -> dict[Any, dict[int, list[list[int]]]]:
    """count -> layer -> each KV head's chosen channels."""
    return {
        count: {layer: [row.nonzero().flatten().tolist() for row in mask] for layer, mask in masks.items()}
        for count, masks in (chosen or {}).items()
    }


if __name__ == "__main__":
    main()
