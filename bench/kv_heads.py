"""Which KV heads' keys and values to hold at 8 bits: int8 spent by head, not by layer.

The engine's 0.40x profile holds five whole layers at 8 bits (`KV_INT8_LAYERS`), chosen by
quantising one layer at a time. A KV head's keys and its values are quantised on their own (keys
per channel over a block, values per token), so each of the 24 x 2 x 2 parts of the default model
(layer, KV head, keys or values) could hold its own bits, and the same bytes (20 parts at 8 bits,
what five layers hold) could go to the 20 parts where 4 bits cost most, wherever they lie.

Two steps:

1. **Sweep** (calibration documents the evaluation does not use, `--sweep-dtype`, fp32 by
   default: its rounding floor is low enough that one part's error shows): each document's prompt
   is read once unquantised; then, for each part, that part alone of the prompt's cache (past the
   sink block) is quantised to 4 bits and the model's own greedy continuation is teacher-forced
   over it; the part's cost is the mean next-token KL against the same continuation over the
   unquantised cache. Prompt chunks after the first do not read quantised history here (the
   sweep quantises once, after the prompt), so this ranks parts by what the continuation reads.
2. **Evaluation** (`--docs` evenly spaced corpus documents, bf16 as the bar is measured, the
   search's own measure: `bench.kv_fake.logprobs`, cold blocks quantised after every step): the
   engine's profile (`int4+int8@5layers-w0`) against int4 with the `--parts` costliest parts at 8
   bits, no window, the sink block, in one run.

`--sweep-along analysis` sweeps where the service writes instead: each calibration document's
narrative prompt naming the polarity the service's labels decided, then the first `--sweep-tokens`
of the service's own answer (JSON under its schema), both made by the engine uncompressed
(`bench.kv_quality`'s analysis pass and forcing, what its KL is measured along); the calibration
documents are then evenly spaced ones of `bench/data/corpus.jsonl` (generated like the KV corpus,
none of its documents) and, with `--calibration-real`, the real data's development split
(`bench.real_data.development`, disjoint from the sample `bench.kv_quality --real` evaluates).
`--alloc-only` prints each allocation's parts at 6 (and 8) bits, as `KV_INT6_PARTS` names them, and
evaluates nothing.

    python -m bench.kv_heads --docs 12 --parts 16,20,24 --out bench/results/kv-heads-cpu.json
    python -m bench.kv_heads --sweep-along analysis --calibration-docs 12 --calibration-real 4 \
        --sweep-dtype bfloat16 --sweep-tokens 64 --alloc 4,6 --alloc-only --out bench/results/kv-heads-analysis.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from bench.kv_calibration import calibration_documents
from bench.kv_fake import (
    BLOCK,
    SINK_BLOCKS,
    Format,
    bytes_ratio,
    counted_ratio,
    fake_quantise,
    head_size,
    logprobs,
    part_bytes,
)
from bench.kv_formats import FORMATS, continuations

PROFILE = "int4+int8@5layers-w0"
GENERATED = Path(__file__).parent / "data" / "corpus.jsonl"

Part = tuple[int, int, str]  # (layer, KV head, "keys" | "values")


@dataclass
class Evaluated:
    format: str
    parts: int  # parts at 8 bits (the profile: its five layers' 20)
    bits_held: dict[int, int]  # bits -> parts held at them
    bytes_ratio: float
    counted_ratio: float
    kl_mean: float
    kl_per_doc: list[float]
    top1: float
    seconds: float


def part_costs(
    model: Any, seqs: list[tuple[torch.Tensor, int]], bits: int = 4, parts: list[Part] | None = None
) -> dict[Part, float]:
    """Each part's mean next-token KL (over the documents' continuations) with that part alone of
    the prompt's cache quantised to `bits`, the sink block kept; `parts`: those measured (every
    part of the model by default)."""
    from transformers import DynamicCache

    config = model.config
    parts = parts or [
        (layer, head, kind)
        for layer in range(config.num_hidden_layers)
        for head in range(config.num_key_value_heads)
        for kind in ("keys", "values")
    ]
    kls: dict[Part, list[float]] = {part: [] for part in parts}
    with torch.inference_mode():
        for ids, prompt_len in seqs:
            cache = DynamicCache()
            last = model(input_ids=ids[None, :prompt_len], cache=cache, use_cache=True).logits[0, -1:]
            rest = ids[None, prompt_len:-1]
            reference = _continue(model, cache, rest, last)
            cold = slice(SINK_BLOCKS * BLOCK, prompt_len // BLOCK * BLOCK)
            for layer, head, kind in parts:
                held = cast(Any, cache.layers[layer])
                tensor = held.keys if kind == "keys" else held.values
                saved = tensor[0, head, cold].clone()
                # (tokens, 1 head, head_dim) a block at a time, as the store quantises it
                blocks = saved.view(-1, BLOCK, 1, saved.shape[-1])
                quantised = torch.cat([
                    fake_quantise(b, b, bits if kind == "keys" else None, bits if kind == "values" else None,
                                  (None, None))[0 if kind == "keys" else 1]
                    for b in blocks
                ])  # fmt: skip
                tensor[0, head, cold] = quantised.view_as(saved)
                # the continuation's own first logits come from the prompt's last token, unquantised
                test = _continue(model, cache, rest, last)[1:]
                # the continuation replaced the cache's tensors (concatenated, then cropped)
                held = cast(Any, cache.layers[layer])
                (held.keys if kind == "keys" else held.values)[0, head, cold] = saved
                kls[(layer, head, kind)].append(
                    float((reference[1:].exp() * (reference[1:] - test)).sum(-1).mean())
                )
    return {part: statistics.mean(values) for part, values in kls.items()}


def _continue(model: Any, cache: Any, rest: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the continuation `rest` (1, n) teacher-forced over `cache` (a prompt's),
    after `last` (the prompt's last logits); the cache is cropped back to the prompt after."""
    logits = model(input_ids=rest, cache=cache, use_cache=True).logits[0]
    cache.crop(-rest.shape[1])
    return torch.log_softmax(torch.cat((last, logits)).float(), dim=-1)


def analysis_sequences(
    model_path: Path, dtype: str, docs: list[dict[str, Any]], tokens: int
) -> list[tuple[torch.Tensor, int]]:
    """Each document's narrative prompt naming the polarity the service's labels decided, followed by
    the first `tokens` of the service's answer, both from the engine uncompressed."""
    from bench.kv_quality import analysis_forcing, analysis_pass
    from engine import Engine, EngineConfig
    from engine.loader import load_model

    loaded = load_model(model_path, dtype=dtype)
    config = EngineConfig(
        model_path=Path("bench"), dynamic_batching=True, max_batch_size=16, kv_cache_bytes=1 << 30,
        prefix_caching=True,
    )  # fmt: skip
    engine = Engine(config, loaded)

    async def answers() -> list[tuple[list[int], list[int]]]:
        async with engine:
            results, _ = await analysis_pass(engine, docs)
            return analysis_forcing(engine, docs, results, tokens)

    return [(torch.tensor([*prompt, *answer]), len(prompt)) for prompt, answer in asyncio.run(answers())]


def sweep_documents(evaluated: list[dict[str, Any]], along: str, n: int, real: int) -> list[dict[str, Any]]:
    """The calibration documents: for continuations, `n` corpus documents not evaluated; along the
    service's answers, `n` of the generated corpus the KV evaluation never reads and `real` of the
    real data's development split (a quarter per language and label, as `bench.kv_quality --real`)."""
    if along == "continuation":
        return calibration_documents(evaluated, n)
    from bench import real_data
    from bench.kv_quality import real_documents

    generated = [json.loads(line) for line in GENERATED.read_text(encoding="utf-8").splitlines()]
    fitted = [generated[(2 * i + 1) * len(generated) // (2 * n)] for i in range(n)]
    if real:
        rows = [row for row in real_data.development(4 * real) if row.polarity != "neutral"]
        fitted += [doc | {"document_id": doc["document_id"].replace("real-", "dev-")}
                   for doc in real_documents(rows, real)]  # fmt: skip
    return fitted


def six_bit_parts(fmt: Format, parts: list[Part], bits: int = 6) -> tuple[str, ...]:
    """The parts `fmt` holds at `bits`, named as KV_INT6_PARTS names them ("16.0.k")."""
    return tuple(
        f"{layer}.{head}.{kind[0]}" for layer, head, kind in sorted(parts)
        if fmt.bits(layer, head)[kind == "values"] == bits
    )  # fmt: skip


def costliest(costs: dict[Part, float], n: int) -> Format:
    """int4, no window, the sink block, with the `n` costliest parts at 8 bits."""
    chosen = sorted(costs, key=costs.__getitem__, reverse=True)[:n]
    heads = {(layer, head) for layer, head, _ in chosen}
    return Format(
        residual=0,
        head_bits={
            (layer, head): (
                8 if (layer, head, "keys") in chosen else 4,
                8 if (layer, head, "values") in chosen else 4,
            )
            for layer, head in heads
        },
    )


def held_bytes(fmt: Format, parts: list[Part], head_dim: int) -> float:
    """Cold bytes per token of `parts` held at `fmt`'s bits, all of them summed."""
    return sum(
        part_bytes(fmt.bits(layer, head)[kind == "values"], head_dim, keys=kind == "keys")
        for layer, head, kind in parts
    )


def allocate(
    costs: dict[Part, float], widths: tuple[int, ...], budget: float, head_dim: int, by: str = "part"
) -> Format:
    """Each part's bits from `widths`: the least modelled cost within `budget` cold bytes per
    token (all parts summed). A part's cost at b bits is modelled as its measured 4-bit cost times
    4^(4 - b): a uniform quantiser's squared error quarters with each bit, and the sweep found the
    parts' costs adding. Every part starts at the narrowest width and is widened greedily by
    modelled cost saved per byte spent; the modelled costs are convex in bytes, so this is the best
    allocation but for the last byte of the budget. `by`: "part" (each part its own bits),
    "layer-kind" (a layer's KV heads the same bits, keys' and values' their own) or "layer" (a
    layer's keys and values of every head the same bits, as the engine's per-layer formats hold
    them); the parts of one choice have their costs and bytes summed."""
    if by not in ("part", "layer-kind", "layer"):
        raise ValueError(f"allocate by part, layer-kind or layer, not {by}")
    if budget < held_bytes(Format(key_bits=min(widths), value_bits=min(widths)), list(costs), head_dim):
        raise ValueError(f"{budget} bytes per token cannot hold every part at {min(widths)} bits")

    # a choice: the parts it sets (one, or a layer's heads' keys or values)
    choices: dict[Part, list[Part]] = {}
    for layer, head, kind in costs:
        choice = (layer, head, kind) if by == "part" else (layer, 0, kind if by == "layer-kind" else "both")
        choices.setdefault(choice, []).append((layer, head, kind))

    def cost(choice: Part, bits: int) -> float:
        return sum(costs[part] for part in choices[choice]) * 4.0 ** (4 - bits)

    def size(choice: Part, bits: int) -> float:
        return sum(part_bytes(bits, head_dim, keys=part[2] == "keys") for part in choices[choice])

    bits = dict.fromkeys(choices, min(widths))
    spent = sum(size(choice, bits[choice]) for choice in choices)
    while True:
        best: tuple[float, Part, int, float] | None = None
        for choice, now in bits.items():
            for wider in (w for w in widths if w > now):
                more = size(choice, wider) - size(choice, now)
                gain = (cost(choice, now) - cost(choice, wider)) / more
                if spent + more <= budget and (best is None or gain > best[0]):
                    best = (gain, choice, wider, more)
        if best is None:
            break
        _, choice, wider, more = best
        bits[choice], spent = wider, spent + more
    held = {part: bits[choice] for choice, parts in choices.items() for part in parts}
    heads = {(layer, head) for layer, head, _ in costs}
    return Format(
        residual=0,
        head_bits={
            (layer, head): (held[(layer, head, "keys")], held[(layer, head, "values")])
            for layer, head in heads
        },
    )


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--docs", type=int, default=12, help="evenly spaced corpus documents evaluated")
    parser.add_argument("--calibration-docs", type=int, default=6, help="corpus documents the sweep runs on")
    parser.add_argument(
        "--sweep-along", choices=("continuation", "analysis"), default="continuation",
        help="the model's greedy continuations of narrative prompts, or the service's answers (see above)",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-real",
        type=int,
        default=0,
        help="with --sweep-along analysis: real development documents",
    )
    parser.add_argument(
        "--alloc-only", action="store_true", help="print the allocations' parts; evaluate nothing"
    )
    parser.add_argument("--tf-tokens", type=int, default=96, help="continuation tokens the evaluation forces")
    parser.add_argument("--sweep-tokens", type=int, default=32, help="continuation tokens the sweep forces")
    parser.add_argument("--sweep-dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--parts", default="20", help="comma-separated counts of parts held at 8 bits")
    parser.add_argument(
        "--alloc",
        default="",
        help="semicolon-separated sets of widths to allocate within the profile's bytes per part, or "
        "with @layer-kind or @layer (see allocate), e.g. 4,6,8;4,6@layer",
    )
    parser.add_argument("--costs", type=Path, help="an earlier run's JSON: its part costs instead of a sweep")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-heads.json"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.kv_quality import load_corpus

    console = Console(width=140)
    args.model = common.model_path(args.model)
    counts = [int(n) for n in args.parts.split(",") if n]
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def load(dtype: str) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        )
        model.eval()
        return model

    docs = load_corpus(args.docs)
    fitted = sweep_documents(docs, args.sweep_along, args.calibration_docs, args.calibration_real)
    began = time.perf_counter()
    if args.costs:
        earlier = json.loads(args.costs.read_text())
        if earlier["calibration_documents"] != [d["document_id"] for d in fitted]:
            raise SystemExit(f"{args.costs} was swept on other calibration documents")
        costs = {(c["layer"], c["head"], c["part"]): c["kl"] for c in earlier["part_costs"]}
    else:
        sweeper = load(args.sweep_dtype)
        if args.sweep_along == "analysis":
            seqs = analysis_sequences(args.model, args.dtype, fitted, args.sweep_tokens)
        else:
            seqs = continuations(sweeper, tokenizer, fitted, args.sweep_tokens)
        costs = part_costs(sweeper, seqs)
        del sweeper
    sweep_s = time.perf_counter() - began
    ranked = sorted(costs, key=costs.__getitem__, reverse=True)
    console.print(f"sweep on {[d['document_id'] for d in fitted]} ({sweep_s:.0f} s); costliest parts:")
    console.print(
        ", ".join(
            f"{layer}.{head}.{kind[0]} {costs[(layer, head, kind)]:.6f}" for layer, head, kind in ranked[:24]
        )
    )

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, head_size(config)
    candidates = [(PROFILE, 2 * kv_heads * len(FORMATS[PROFILE].layer_bits), FORMATS[PROFILE])]
    candidates += [(f"int4+int8@{n}parts-w0", n, costliest(costs, n)) for n in counts]
    every = [
        (layer, head, kind)
        for layer in range(layers)
        for head in range(kv_heads)
        for kind in ("keys", "values")
    ]
    budget = held_bytes(FORMATS[PROFILE], every, head_dim)
    for spec in (spec for spec in args.alloc.split(";") if spec):
        listed, _, by = spec.partition("@")
        widths = tuple(sorted(int(b) for b in listed.split(",")))
        fmt = allocate(costs, widths, budget, head_dim, by=by or "part")
        held = [fmt.bits(layer, head)[kind == "values"] for layer, head, kind in every]
        name = f"alloc{{{','.join(map(str, widths))}}}{'@' + by if by else ''}-w0"
        candidates.append((name, held.count(8), fmt))
        for bits in sorted({b for b in held if b > 4}):
            console.print(f"{name}, {bits} bits: {','.join(six_bit_parts(fmt, every, bits))}")
    if args.alloc_only:
        write(args, docs, fitted, costs, sweep_s, [], candidates)
        console.print(f"wrote {args.out}")
        return
    model = load(args.dtype)
    seqs = continuations(model, tokenizer, docs, args.tf_tokens)
    reference = [logprobs(model, ids, n, Format(quantise=False)) for ids, n in seqs]
    results: list[Evaluated] = []
    for name, n, fmt in candidates:
        start = time.perf_counter()
        kls, top1 = [], []
        for (ids, prompt_len), ref in zip(seqs, reference, strict=True):
            test = logprobs(model, ids, prompt_len, fmt)
            kls.append(float((ref.exp() * (ref - test)).sum(-1).mean()))
            picked = ref.gather(-1, test.argmax(-1, keepdim=True))
            top1.append(float((picked == ref.amax(-1, keepdim=True)).float().mean()))
        counted = statistics.median(
            counted_ratio(fmt, layers, head_dim, len(ids), kv_heads) for ids, _ in seqs
        )
        held_at = Counter(b for layer, head, kind in every if (b := fmt.bits(layer, head)[kind == "values"]))
        results.append(Evaluated(name, n, dict(sorted(held_at.items())), bytes_ratio(fmt, layers, head_dim, kv_heads=kv_heads), counted,
                                 statistics.mean(kls), kls, statistics.mean(top1), time.perf_counter() - start))  # fmt: skip
        console.print(f"{name}: KL {results[-1].kl_mean:.5f} at {counted:.3f} counted")
        write(args, docs, fitted, costs, sweep_s, results, candidates)
    profile = results[0]
    table = Table("format", "parts by bits", "cold bytes/token vs bf16", "counted", "KL mean", "lower on",
                  "median ratio", "top-1", title=f"int8 by KV head part, {len(docs)} documents x {args.tf_tokens} tokens")  # fmt: skip
    for r in results:
        ratios = [a / b for a, b in zip(r.kl_per_doc, profile.kl_per_doc, strict=True)]
        table.add_row(r.format, " ".join(f"{n}@{b}" for b, n in r.bits_held.items()), f"{r.bytes_ratio:.3f}", f"{r.counted_ratio:.3f}", f"{r.kl_mean:.5f}",
                      f"{sum(x < 1 for x in ratios)} of {len(ratios)}", f"{statistics.median(ratios):.2f}",
                      f"{r.top1:.4f}")  # fmt: skip
    console.print(table)
    console.print(f"wrote {args.out}")


def write(
    args: Any, docs: list[dict[str, Any]], fitted: list[dict[str, Any]], costs: dict[Part, float], sweep_s: float,
    results: list[Evaluated], candidates: list[tuple[str, int, Format]],
) -> None:  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    specs = {name: replace(fmt, head_bits={}) for name, _, fmt in candidates}
    args.out.write_text(json.dumps({
        "machine": {"threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "documents": [d["document_id"] for d in docs],
        "calibration_documents": [d["document_id"] for d in fitted],
        "sweep_seconds": sweep_s,
        "part_costs": [
            {"layer": layer, "head": head, "part": kind, "kl": kl}
            for (layer, head, kind), kl in sorted(costs.items(), key=lambda item: -item[1])
        ],
        "results": [asdict(r) for r in results],
        "formats": {
            name: asdict(specs[name]) | {"head_bits": [[layer, head, *bits] for (layer, head), bits in fmt.head_bits.items()]}
            for name, _, fmt in candidates
        },
    }, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
