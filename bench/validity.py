"""Schema validity of constrained decoding with the real model: every bundled sample and every
corpus document through the analysis path (prompt -> engine with the JSON Schema -> parser).

Prints a table per kind x language, writes JSON, and exits non-zero if any analysis failed.

    python -m bench.validity --out bench/results/validity-cpu.json
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from opentelemetry import trace
from rich.console import Console
from rich.table import Table

from bench import common
from engine import Engine, EngineConfig
from pipeline.analyzer import AnalysisFailed, Analyzer
from pipeline.backends import EmbeddedBackend
from pipeline.client import load_documents
from pipeline.codec import Document
from pipeline.demo import sample_paths
from pipeline.labels import LabelPolicy
from prompts import detect_language
from schemas import DocumentEvent, DocumentKind, SourceCoordinates

CORPUS = Path(__file__).with_name("data") / "corpus.jsonl"


def documents() -> list[Document]:
    events = load_documents(sample_paths())
    events += [
        DocumentEvent.model_validate(json.loads(line))
        for line in CORPUS.read_text(encoding="utf-8").splitlines()
    ]
    out = []
    for i, event in enumerate(events):
        out.append(
            Document(
                event_id=f"validity-{i}",
                document_id=event.document_id or f"doc-{i}",
                kind=event.kind or DocumentKind.COMPLAINT,
                language=event.language or detect_language(event.text),
                text=event.text,
                source=SourceCoordinates(topic="bench", partition=0, offset=i),
            )
        )
    return out


async def run(model: Path, max_batch: int, policy: LabelPolicy) -> list[dict[str, object]]:
    config = EngineConfig(
        model_path=model, dynamic_batching=True, max_batch_size=max_batch, kv_cache_bytes=1 << 30
    )
    engine = await asyncio.to_thread(Engine.from_config, config)
    analyzer = Analyzer(
        EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=1024, attempts=2, policy=policy
    )
    async with engine:

        async def one(document: Document) -> dict[str, object]:
            started = time.perf_counter()
            try:
                outcome = await analyzer.analyze(document, started)
            except AnalysisFailed as exc:
                return {"id": document.document_id, "kind": document.kind, "language": document.language.value,
                        "valid": False, "attempts": exc.attempts, "error": str(exc), "raw": exc.raw_output}  # fmt: skip
            return {"id": document.document_id, "kind": document.kind, "language": document.language.value,
                    "valid": True, "attempts": outcome.attempts, "output_tokens": outcome.output_tokens,
                    "seconds": time.perf_counter() - started, "analysis": outcome.analysis.model_dump(mode="json")}  # fmt: skip

        return list(await asyncio.gather(*(one(d) for d in documents())))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/validity.json"))
    args = parser.parse_args()
    console = Console(width=120)
    started = time.perf_counter()
    # The service's label policy for the model (the bundled default's: its polarity probe).
    results = asyncio.run(run(common.model_path(args.model), args.max_batch, common.label_policy(args.model)))
    wall = time.perf_counter() - started
    table = Table("kind", "language", "documents", "valid", "valid on 1st attempt", title="schema validity")
    cells = Counter((r["kind"], r["language"]) for r in results)
    for kind, language in sorted(cells):
        rows = [r for r in results if (r["kind"], r["language"]) == (kind, language)]
        table.add_row(str(kind), str(language), str(len(rows)), str(sum(bool(r["valid"]) for r in rows)),
                      str(sum(bool(r["valid"]) and r["attempts"] == 1 for r in rows)))  # fmt: skip
    console.print(table)
    valid = sum(bool(r["valid"]) for r in results)
    console.print(f"{valid}/{len(results)} valid ({valid / len(results):.1%}) in {wall:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"wall_s": wall, "valid": valid, "total": len(results), "results": results},
                                   ensure_ascii=False, indent=1))  # fmt: skip
    raise SystemExit(0 if valid == len(results) else 1)


if __name__ == "__main__":
    main()
