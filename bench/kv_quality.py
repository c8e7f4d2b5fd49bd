"""KV-compression harness: memory and quality of each compression profile, in one run.

For every profile, on the documents of bench/data/kv-corpus.jsonl (zh/en, three kinds) and, with
`--real N`, N labelled documents no one here wrote (`real_documents`):
  * analysis pass: each document's analysis as the service makes it, labels scored by the
    `Analyzer` under that profile, then the narrative generated with its JSON Schema (all documents
    at once, the same batch size for every profile): tokens/s, p50/p95 latency, valid JSON;
  * KV bytes per token: what the pool holds for a document at its last step (its block table,
    full-precision and quantised blocks, exact bytes, all layers) over the tokens it holds, as a
    ratio to bf16; and how many 2,000-character documents fit a fixed pool at that size (less the
    full-precision room a profile keeps for prompts being read, KV_PROMPT_TOKENS);
  * teacher-forced pass (every profile, the uncompressed one first): the document's prompt, then
    the uncompressed profile's output token by token (its first --tf-tokens); the uncompressed
    profile's own pass records the reference distributions (top-k per position), every other
    profile's gives next-token KL divergence and top-1 agreement against them. Both sides come from
    the same kind of pass (the same prompts and forced tokens, submitted together), so a profile
    that changes nothing measures 0 (`off-again`); distributions recorded while the analyses were
    generated would differ by batching order alone (~0.0003 KL on this CPU in bf16). KL is taken
    over the reference's top-k tokens plus one bucket for the rest of the vocabulary (a lower bound
    on the full KL, tight when the top-k hold the mass). With `--forced continuation` the forced
    tokens are `bench.kv_formats`' instead (its prompts naming the label's polarity, the model's
    unconstrained greedy continuation): the format search's measure taken through the engine;
  * analysis agreement with the uncompressed profile: sentiment polarity, doubt and expectation
    flags, and a character-bigram Dice similarity of the core viewpoints; and with the corpus
    label where there is one (complaints: negative).
Prefix caching is off unless `--prefix-caching`: then the label questions, which the service asks
over one prompt's cached blocks, do not each read the whole document again, and a document's bytes
count the shared blocks its table holds as its own.

    python -m bench.kv_quality --out bench/results/kv-quality-cpu.json
    # 200 documents, the uncompressed reference kept so that later runs add profiles against it
    python -m bench.kv_quality --real 80 --profiles off,int4+int8@5-w0 \
        --reference ~/.cache/deepanalyze/kv-quality/reference.pt --out bench/results/kv-quality-200.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from rich.console import Console
from rich.table import Table

from bench import common, real_data
from bench.kv_forced import Forcing, Reference, continuation_forcing, reference_pass, teacher_forced_pass
from bench.kv_formats import SENSITIVE, SIX_BIT_LAYERS, SIX_BIT_PARTS, SIX_BIT_PARTS_ANSWERS
from engine import Engine, EngineConfig, SamplingParams
from engine.kv_cache import ColdStore, KVShape
from engine.loader import LoadedModel, load_model
from pipeline.analyzer import Analyzer
from pipeline.backends import EmbeddedBackend
from pipeline.codec import Document
from prompts import AnalysisParseError, parse_narrative, render
from schemas import BUILT_IN_KINDS, DocumentKind, Language, Polarity, SourceCoordinates, narrative_json_schema

CORPUS = Path(__file__).with_name("data") / "kv-corpus.jsonl"

# int4, but int8 in the layers where 4-bit error costs the default model most (ranked one layer at a
# time by bench.kv_formats: its SENSITIVE); a model with fewer layers refuses it.
MIXED: dict[str, Any] = {"kv_compression": True, "kv_quant_bits": 4, "kv_int8_layers": SENSITIVE}
# The same bytes as 6 bits in ten layers (bench.kv_formats' SIX_BIT_LAYERS, allocated by bench.kv_heads).
MIXED6: dict[str, Any] = {"kv_compression": True, "kv_quant_bits": 4, "kv_int6_layers": SIX_BIT_LAYERS}

PROFILES: dict[str, dict[str, Any]] = {
    "off": {},
    "off-again": {},  # the measurement's own floor: batching order alone, no compression
    # The model's numerical floor: no compression, exact same maths, prompts read in 128-token
    # instead of 192-token chunks, so only bf16 rounding differs from "off".
    "off-chunk-128": {"max_tokens_per_step": 128},
    "int8": {"kv_compression": True, "kv_quant_bits": 8},
    "int4": {"kv_compression": True, "kv_quant_bits": 4},
    # Keys and values rotated by a Hadamard matrix before quantising (the same bytes).
    "int4-rot": {"kv_compression": True, "kv_quant_bits": 4, "kv_rotate": True},
    "int8-rot": {"kv_compression": True, "kv_quant_bits": 8, "kv_rotate": True},
    "prune-0.5": {"kv_compression": True, "kv_quant_bits": 16, "kv_keep_ratio": 0.5},
    "article-heuristic-0.5": {
        "kv_compression": True,
        "kv_quant_bits": 16,
        "kv_keep_ratio": 0.5,
        "kv_prune_policy": "heuristic",
    },
    "int4+int8@5": MIXED,
    "int4+int8@5-w16": MIXED | {"kv_residual_tokens": 16},
    # Only the block being written at full precision (no window), with and without the sink block.
    "int4+int8@5-w0": MIXED | {"kv_residual_tokens": 0},
    "int4+int8@5-w0-nosink": MIXED | {"kv_residual_tokens": 0, "kv_sink_tokens": 0},
    "int4+int6@10-w0": MIXED6 | {"kv_residual_tokens": 0},
    # The same bytes as 6 bits in forty (layer, KV head, keys or values) parts (SIX_BIT_PARTS).
    "int4+int6@40parts-w0": {
        "kv_compression": True,
        "kv_quant_bits": 4,
        "kv_int6_parts": SIX_BIT_PARTS,
        "kv_residual_tokens": 0,
    },
    # The forty parts, prompts read over a full-precision history (2,048 tokens of room in the pool)
    # and quantised once they decode: what is read at a prompt's end sees no quantisation.
    "int4+int6@40parts-w0-prompts2k": {
        "kv_compression": True,
        "kv_quant_bits": 4,
        "kv_int6_parts": SIX_BIT_PARTS,
        "kv_residual_tokens": 0,
        "kv_prompt_tokens": 2048,
    },
    # The same bytes, the forty parts allocated along the service's answers (SIX_BIT_PARTS_ANSWERS).
    "int4+int6@40answers-w0": {
        "kv_compression": True,
        "kv_quant_bits": 4,
        "kv_int6_parts": SIX_BIT_PARTS_ANSWERS,
        "kv_residual_tokens": 0,
    },
    "int4+prune-0.7": {"kv_compression": True, "kv_quant_bits": 4, "kv_keep_ratio": 0.7},
    "int8+prune-0.4": {"kv_compression": True, "kv_quant_bits": 8, "kv_keep_ratio": 0.4},
    "aggressive-int4+prune-0.35-w16": {
        "kv_compression": True,
        "kv_quant_bits": 4,
        "kv_keep_ratio": 0.35,
        "kv_residual_tokens": 16,
    },
}


@dataclass
class DocResult:
    document_id: str
    kind: str
    language: str
    chars: int
    label: str | None
    prompt_tokens: int
    output_ids: list[int]
    latency_s: float
    ttft_s: float
    valid: bool
    analysis: dict[str, Any] | None
    kv_bytes: int  # held by the document's block table at its last step
    kv_tokens: int  # tokens held then
    error: str | None = None  # an invalid answer: why, and what the model wrote
    kl: list[float] = field(default_factory=list)  # teacher-forced, per output position
    top1: list[bool] = field(default_factory=list)


def load_corpus(limit: int | None) -> list[dict[str, Any]]:
    """The corpus, or an evenly spaced `limit` of it (the file is ordered by kind and language)."""
    docs = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    if not limit or limit >= len(docs):
        return docs
    return [docs[i * len(docs) // limit] for i in range(limit)]


def real_documents(sample: list[real_data.Labelled], n: int) -> list[dict[str, Any]]:
    """`n` of `sample`'s labelled documents, an equal share per language and label, evenly spaced in
    each; run on the quality benchmark's own evaluation sample (`bench.real_data.sample(300)`, no one
    here wrote it), so the agreement is measured on the documents its accuracy is. Chinese news
    posts go as filings, English review sentences as complaints (`bench.quality` reads every one as a
    filing, and again as a complaint in its second reading)."""
    kinds = {"zh": DocumentKind.FILING, "en": DocumentKind.COMPLAINT}
    groups: dict[tuple[str, str], list[real_data.Labelled]] = {}
    for row in sample:
        groups.setdefault((row.language, row.polarity), []).append(row)
    take = n // len(groups)
    docs = []
    for (language, polarity), rows in sorted(groups.items()):
        for i in range(take):
            row = rows[i * len(rows) // take]
            docs.append({
                "document_id": f"real-{row.source}-{polarity}-{i:03d}", "kind": kinds[language].value,
                "language": language, "text": row.text, "label_polarity": polarity,
            })  # fmt: skip
    return docs


def bf16_shape(engine: Engine) -> KVShape:
    """The cache's shape in bf16: bytes are counted as a bf16 cache holds them whatever the run's
    dtype (an fp32 run's scales take twice the bytes and its codes the same, so its own ratio to
    full precision would be smaller than the one the article's bf16 figure compares with)."""
    return replace(engine.cache.shape, dtype=torch.bfloat16)


def held(engine: Engine, seq_id: int) -> tuple[int, int]:
    """Exact bytes of the sequence's blocks (all layers), as a bf16 cache holds them, and the
    tokens it holds."""
    blocks, cache, shape = engine.blocks, engine.cache, bf16_shape(engine)
    table = blocks.table(seq_id)
    cold = sum(blocks.is_cold(b) for b in table)
    cold_block = ColdStore.bytes_per_block(shape, cache.cold.formats, cache.block_size) if cache.cold else 0
    size = cold * cold_block + (len(table) - cold) * shape.bytes_per_token * cache.block_size
    seq = engine.scheduler.running
    tokens = next((s.num_computed for s in seq if s.seq_id == seq_id), 0)
    return size, tokens


async def analysis_pass(engine: Engine, docs: list[dict[str, Any]]) -> tuple[list[DocResult], float]:
    """Every analysis as the service makes it (labels scored by `Analyzer.label`, then the
    narrative generated)."""
    schemas = {lang: json.dumps(narrative_json_schema(lang)) for lang in Language}
    analyzer = Analyzer(EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=1024, attempts=1)

    async def one(index: int, doc: dict[str, Any]) -> DocResult:
        kind, language = DocumentKind(doc["kind"]), Language(doc["language"])
        labels = await analyzer.label(kind, language, doc["text"])
        ids = engine.format_chat(
            render(BUILT_IN_KINDS[kind], language, doc["text"], labels.polarity).messages
        )
        last: dict[str, tuple[int, int]] = {}
        seq_id: list[int] = []

        def observe(logits: torch.Tensor) -> None:
            last["held"] = held(engine, seq_id[0])

        params = SamplingParams(max_new_tokens=1024, json_schema=schemas[language])
        handle = engine.submit(ids, params, observe)
        seq_id.append(handle.request_id)
        result = await handle.result()
        error = None
        try:
            narrative = parse_narrative(result.text, language, doc["text"])
            source = SourceCoordinates(topic="kv", partition=0, offset=index)
            document = Document(
                event_id=doc["document_id"], document_id=doc["document_id"], kind=kind, language=language,
                text=doc["text"], source=source,
            )  # fmt: skip
            triage = Analyzer.triage_of(document, BUILT_IN_KINDS[kind], labels)
            assembled = Analyzer.assemble(narrative, labels, triage, ())
            analysis: dict[str, Any] | None = assembled.model_dump(mode="json")
        except AnalysisParseError as exc:
            analysis, error = None, f"{exc} | raw output: {result.text}"
        kv_bytes, kv_tokens = last.get("held", (0, 0))
        return DocResult(
            doc["document_id"], kind.value, language.value, len(doc["text"]), doc.get("label_polarity"),
            len(ids), result.token_ids, result.total_s, result.ttft_s, analysis is not None, analysis,
            kv_bytes, kv_tokens, error,
        )  # fmt: skip

    started = time.perf_counter()
    results = list(await asyncio.gather(*(one(i, d) for i, d in enumerate(docs))))
    wall = time.perf_counter() - started
    return results, wall


def analysis_forcing(
    engine: Engine, docs: list[dict[str, Any]], reference: list[DocResult], limit: int
) -> Forcing:
    """Each document's narrative prompt naming the polarity the reference decided, then the first
    `limit` tokens of the reference's analysis: KL where the service's answers are written."""
    out: Forcing = []
    for doc, result in zip(docs, reference, strict=True):
        kind, language = DocumentKind(doc["kind"]), Language(doc["language"])
        polarity = Polarity(result.analysis["sentiment"]["polarity"]) if result.analysis else Polarity.NEUTRAL
        messages = render(BUILT_IN_KINDS[kind], language, doc["text"], polarity).messages
        out.append((engine.format_chat(messages), result.output_ids[:limit]))
    return out


def dice(a: str, b: str) -> float:
    """Character-bigram Dice similarity (works for Chinese and English alike)."""
    grams = [{x[i : i + 2] for i in range(len(x) - 1)} for x in (a.lower(), b.lower())]
    if not grams[0] and not grams[1]:
        return 1.0
    return 2 * len(grams[0] & grams[1]) / (len(grams[0]) + len(grams[1]))


def agreement(results: list[DocResult], reference: list[DocResult]) -> dict[str, float]:
    pairs = [
        (r.analysis, b.analysis) for r, b in zip(results, reference, strict=True) if r.analysis and b.analysis
    ]
    labelled = [(r.analysis, r.label) for r in results if r.label and r.analysis]

    def share(values: list[bool]) -> float:
        return sum(values) / len(values) if values else float("nan")

    def flag(name: str) -> float:
        return share([a["sentiment"][name] == b["sentiment"][name] for a, b in pairs])

    return {
        "polarity": flag("polarity"),
        "doubt": flag("implies_doubt"),
        "expectation": flag("implies_expectation"),
        "viewpoint_dice": statistics.mean([dice(a["core_viewpoint"], b["core_viewpoint"]) for a, b in pairs])
        if pairs
        else float("nan"),
        "label_polarity": share([a["sentiment"]["polarity"] == label for a, label in labelled]),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


Baseline = tuple[list[DocResult], Reference]


def reference_key(args: Any, loaded: LoadedModel, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What an uncompressed run must share with this one to stand as its reference."""
    return {
        "model": str(args.model), "dtype": str(loaded.dtype), "torch": str(torch.__version__),
        "documents": [d["document_id"] for d in docs], "max_batch": args.max_batch,
        "pool_mib": args.pool_mib, "top_k": args.top_k, "tf_tokens": args.tf_tokens,
        "prefix_caching": args.prefix_caching,
        "reference_pass": "teacher-forced",  # references recorded while generating no longer match
        "forced": args.forced,
        "label_scores": "fp32 head rows",  # scored words' logits no longer rounded to bf16 (engine.scoring)
    }  # fmt: skip


def save_reference(path: Path, key: dict[str, Any], base: Baseline, summary: dict[str, Any]) -> None:
    """The uncompressed run (its analyses, outputs and top-k distributions up to the forced
    length), so that later runs compare further profiles with the same reference."""
    results, ref = base
    limit = key["tf_tokens"]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "key": key, "summary": summary, "results": [asdict(r) for r in results],
        "ids": [t[:limit].clone() for t in ref.ids], "logp": [t[:limit].clone() for t in ref.logp],
    }, path)  # fmt: skip


def load_reference(path: Path, key: dict[str, Any]) -> tuple[Baseline, dict[str, Any]] | None:
    """A saved uncompressed run made under `key`, or None (no file, or made under another)."""
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["key"] != key:
        return None
    results = [DocResult(**r) for r in saved["results"]]
    return (results, Reference(saved["ids"], saved["logp"])), saved["summary"]


async def run_profile(
    loaded: LoadedModel, name: str, docs: list[dict[str, Any]], args: Any, base: Baseline | None,
    forcing: Forcing | None = None,
) -> tuple[dict[str, Any], list[DocResult], Reference]:  # fmt: skip
    """One profile's analyses and bytes; its KL along `forcing` (default: the reference's
    analyses, `analysis_forcing`) against `base`, or, with no base, the reference recorded."""
    config = EngineConfig(
        model_path=Path("bench"), dynamic_batching=True, max_batch_size=args.max_batch,
        kv_cache_bytes=args.pool_mib << 20, prefix_caching=args.prefix_caching, **PROFILES[name],
    )  # fmt: skip
    engine = Engine(config, loaded)
    async with engine:
        results, wall = await analysis_pass(engine, docs)
        along = forcing or analysis_forcing(
            engine, docs, results if base is None else base[0], args.tf_tokens
        )
        if base is None:  # the reference: its distributions along its own outputs
            ref, forced = await reference_pass(engine, along, args.top_k), []
        else:
            ref, forced = base[1], await teacher_forced_pass(engine, along, base[1])
        preemptions = engine.stats().num_preemptions
    for r, (kl, top1) in zip(results, forced, strict=False):
        r.kl, r.top1 = kl, top1
    bf16 = bf16_shape(engine).bytes_per_token
    ratios = [r.kv_bytes / r.kv_tokens / bf16 for r in results if r.kv_tokens]
    long_docs = [r.kv_bytes for r in results if r.chars >= 1500 and r.kv_tokens]
    kls = [k for r in results for k in r.kl]
    summary = {
        "profile": name, "settings": PROFILES[name], "documents": len(results),
        "valid_json": sum(r.valid for r in results) / len(results),
        "kv_ratio_median": statistics.median(ratios) if ratios else float("nan"),
        "kv_ratio_max": max(ratios) if ratios else float("nan"),
        "bytes_per_long_doc": statistics.median(long_docs) if long_docs else float("nan"),
        # the pool less the full-precision room kept for prompts being read (KV_PROMPT_TOKENS)
        "fit_2000_char_docs": int(((args.fit_pool_mib << 20) - config.kv_prompt_tokens * bf16)
                                  // statistics.median(long_docs)) if long_docs else 0,
        "tok_s": sum(len(r.output_ids) for r in results) / wall, "wall_s": wall,
        "p50_s": _pct([r.latency_s for r in results], 50), "p95_s": _pct([r.latency_s for r in results], 95),
        "preemptions": preemptions,
        "kl_mean": statistics.mean(kls) if kls else None,
        "top1": sum(t for r in results for t in r.top1) / len(kls) if kls else None,
    }  # fmt: skip
    if base is not None:
        summary |= {f"agree_{k}": v for k, v in agreement(results, base[0]).items()}
    else:
        summary |= {"agree_label_polarity": agreement(results, results)["label_polarity"]}
    return summary, results, ref


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument(
        "--docs", type=int, default=None, help="first N documents of the corpus (default: all)"
    )
    parser.add_argument(
        "--real", type=int, default=0,
        help="add this many real labelled documents (bench.real_data; a quarter per language and label)",
    )  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument(
        "--pool-mib", type=int, default=1024, help="KV pool for the quality runs (no preemption)"
    )
    parser.add_argument(
        "--fit-pool-mib", type=int, default=256, help="pool for the 2,000-character fit count"
    )
    parser.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="the model's and cache's (auto: bf16 where computed natively); bytes count as bf16 either way",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-caching", action="store_true",
        help="as the service runs: a document's label questions share its prompt's blocks (several times "
        "faster); a document's bytes then count the shared blocks its table holds",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int, default=256)
    parser.add_argument("--tf-tokens", type=int, default=128, help="teacher-force this many output tokens")
    parser.add_argument(
        "--forced", choices=("analysis", "continuation"), default="analysis",
        help="what KL is measured along: the uncompressed profile's analyses (the service's answers), "
        "or bench.kv_formats' prompts and unconstrained greedy continuations (its KL through the engine)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-quality.json"))
    parser.add_argument(
        "--reference", type=Path, default=None,
        help="keep the uncompressed run here and reuse it when a later run has the same model, dtype, "
        "documents and sizes (profiles measured over several runs against one reference)",
    )  # fmt: skip
    args = parser.parse_args()
    console = Console(width=160)
    args.model = common.model_path(args.model)
    loaded = load_model(args.model, dtype=args.dtype)
    docs = load_corpus(args.docs) + (real_documents(real_data.sample(300), args.real) if args.real else [])
    names = [n for n in args.profiles.split(",") if n]
    if names[0] != "off":
        names.insert(0, "off")  # the reference every other profile is compared with
    summaries, per_doc = [], {}
    base: Baseline | None = None
    key = reference_key(args, loaded, docs)
    if args.reference is not None and (saved := load_reference(args.reference, key)) is not None:
        base, summary = saved
        console.print(f"profile off: the saved reference {args.reference}")
        summaries.append(summary | {"reference": str(args.reference)})
        per_doc["off"] = doc_rows(base[0])
        names.remove("off")
    elif args.reference is not None and args.reference.exists():
        console.print(f"{args.reference} was made under other settings: measuring off again, replacing it")
    forcing = continuation_forcing(loaded, docs, args.tf_tokens) if args.forced == "continuation" else None
    for name in names:
        console.print(f"profile {name}: {len(docs)} documents ...")
        summary, results, ref = asyncio.run(run_profile(loaded, name, docs, args, base, forcing))
        if base is None:
            base = (results, ref)
            if args.reference is not None:
                save_reference(args.reference, key, base, summary)
        summaries.append(summary)
        per_doc[name] = doc_rows(results)
        console.print(f"  {summary['tok_s']:.1f} tok/s, KV ratio {summary['kv_ratio_median']:.3f}")
        write(args, summaries, per_doc)  # after every profile: a long run interrupted keeps what it measured

    table = Table("profile", "KV bytes/token vs bf16", "fit 2k-char docs", "KL mean", "top-1", "polarity =",
                  "doubt =", "expect =", "viewpoint sim", "label", "valid JSON", "tok/s", "p95 s",
                  title=f"KV compression, {len(docs)} documents, {loaded.dtype}, batch {args.max_batch}")  # fmt: skip

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for s in summaries:
        table.add_row(s["profile"], f(s["kv_ratio_median"], ".3f"), str(s["fit_2000_char_docs"]), f(s["kl_mean"], ".4f"),
                      f(s["top1"], ".3f"), f(s.get("agree_polarity"), ".3f"), f(s.get("agree_doubt"), ".3f"),
                      f(s.get("agree_expectation"), ".3f"), f(s.get("agree_viewpoint_dice"), ".3f"),
                      f(s.get("agree_label_polarity"), ".3f"), f(s["valid_json"], ".3f"), f(s["tok_s"], ".1f"),
                      f(s["p95_s"], ".1f"))  # fmt: skip
    console.print(table)
    console.print(f"wrote {args.out}")


def doc_rows(results: list[DocResult]) -> list[dict[str, Any]]:
    """Per-document rows for the JSON: the mean KL, not every position's; no token ids."""
    rows = []
    for r in results:
        row = asdict(r) | {"kl_mean": statistics.mean(r.kl) if r.kl else None}
        for bulky in ("kl", "top1", "output_ids"):
            row.pop(bulky)
        rows.append(row)
    return rows


def write(args: Any, summaries: list[dict[str, Any]], per_doc: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": common.machine()
        | {"threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "summaries": summaries, "documents": per_doc,
    }, indent=1, ensure_ascii=False, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
