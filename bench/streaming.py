"""How soon the pages' report starts to fill in: per bundled sample, when the analysis as written
(`Analyzer.analyze`'s progress, what the pages show) first has the labels and the viewpoint,
against when the whole analysis is ready. One document at a time, the real model.

Prints a table, writes JSON.

    python -m bench.streaming --out bench/results/streaming-cpu.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from opentelemetry import trace
from rich.console import Console
from rich.table import Table

from bench import common
from engine import Engine, EngineConfig
from pipeline.analyzer import Analyzer
from pipeline.backends import EmbeddedBackend
from pipeline.client import load_documents
from pipeline.codec import Document
from pipeline.demo import sample_paths
from prompts import detect_language
from schemas import SourceCoordinates


async def run(model: Path, policy: Any) -> list[dict[str, Any]]:
    config = EngineConfig(model_path=model, kv_cache_bytes=1 << 29)
    engine = await asyncio.to_thread(Engine.from_config, config)
    rows = []
    async with engine:
        analyzer = Analyzer(EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=1024, attempts=2,
                            policy=policy)  # fmt: skip
        await analyzer.prepare()
        for i, event in enumerate(load_documents(sample_paths())):
            document = Document(
                event_id=str(i), document_id=event.document_id or str(i), kind=event.kind or "complaint",
                language=event.language or detect_language(event.text), text=event.text,
                source=SourceCoordinates(topic="bench", partition=0, offset=i),
            )  # fmt: skip
            updates: list[tuple[float, set[str]]] = []
            started = time.perf_counter()
            await analyzer.analyze(document, started, _timer(updates, started))
            total = time.perf_counter() - started
            viewpoint = next(t for t, keys in updates if "core_viewpoint" in keys)
            rows.append({"document": document.document_id, "labels_s": updates[0][0], "viewpoint_s": viewpoint,
                         "total_s": total, "updates": len(updates)})  # fmt: skip
    return rows


def _timer(updates: list[tuple[float, set[str]]], started: float) -> Any:
    """A progress callback noting when each update came and what it held."""
    return lambda written: updates.append((time.perf_counter() - started, set(written)))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = asyncio.run(run(common.model_path(args.model), common.label_policy(args.model)))
    table = Table(title="the report as written: when the pages first show each part")
    for column in ("document", "labels", "viewpoint", "whole analysis", "viewpoint / whole", "updates"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["document"], f"{r['labels_s']:.1f} s", f"{r['viewpoint_s']:.1f} s", f"{r['total_s']:.1f} s",
                      f"{r['viewpoint_s'] / r['total_s']:.0%}", str(r["updates"]))  # fmt: skip
    Console().print(table)
    share = statistics.median(r["viewpoint_s"] / r["total_s"] for r in rows)
    print(f"median: the viewpoint shows at {share:.0%} of the wait for the whole analysis")
    if args.out is not None:
        result = {"machine": {"platform": platform.platform()}, "rows": rows, "median_viewpoint_share": share}
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
