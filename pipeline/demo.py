"""`make demo`: a broker of its own (Apache Kafka; Tansu without Java), the default model, the
bundled samples in, readable reports out.

Starts everything it needs, publishes the six bundled documents (complaint, meeting notes and
filing, each in Chinese and English), waits for an answer to each and prints it. Exits non-zero
when any document did not come back as an analysis.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.app import resolve_model_path, serve
from pipeline.broker import embedded_broker
from pipeline.client import collect_answers, load_documents, publish_documents
from pipeline.report import render_dead_letter, render_event
from pipeline.service import Service
from pipeline.settings import Settings, load_settings
from schemas import AnalysisEvent


def sample_paths() -> list[Path]:
    folder = resources.files("pipeline") / "samples"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json"))


async def run_demo(console: Console, timeout_s: float) -> int:
    started = time.perf_counter()
    overrides: dict[str, object] = {
        "consumer_group": f"deepanalyze-demo-{uuid.uuid4().hex[:8]}",
        "status_port": 0,
    }
    if "DYNAMIC_BATCHING" not in os.environ:
        overrides["dynamic_batching"] = True  # the demo shows the batching engine unless told otherwise
    base = load_settings(**overrides)
    console.rule("[bold]DeepAnalyze demo")
    with embedded_broker() as broker:
        console.print(f"broker: {broker.kind} on {broker.bootstrap_servers}", highlight=False)
        t0 = time.perf_counter()
        model_path = resolve_model_path(base)
        console.print(f"model ready in {time.perf_counter() - t0:.1f} s", highlight=False)
        console.print(f"  {model_path}", soft_wrap=True, highlight=False)
        settings = Settings(
            **{
                **base.model_dump(),
                "kafka_bootstrap_servers": broker.bootstrap_servers,
                "kafka_enable_idempotence": broker.idempotent,
                "model_path": model_path,
            }
        )
        stop = asyncio.Event()
        ready = asyncio.Event()

        def on_ready(service: Service, port: int) -> None:
            console.print(f"status: http://{settings.status_host}:{port}/api/status")
            ready.set()

        worker = asyncio.create_task(serve(settings, stop, on_ready=on_ready))
        try:
            await asyncio.wait(
                {worker, asyncio.ensure_future(ready.wait())}, return_when=asyncio.FIRST_COMPLETED
            )
            if worker.done():
                await worker
            documents = load_documents(sample_paths())
            sent = await publish_documents(settings, documents)
            console.print(
                f"published {len(sent)} documents; analysing "
                f"(DYNAMIC_BATCHING={str(settings.dynamic_batching).lower()}, "
                f"MAX_BATCH_SIZE={settings.max_batch_size}) ..."
            )
            t1 = time.perf_counter()
            answers = await collect_answers(settings, {s.event_id for s in sent}, timeout_s)
            elapsed = time.perf_counter() - t1
        finally:
            stop.set()
            await asyncio.gather(worker, return_exceptions=True)

    missing = 0
    summary = Table("document", "kind", "lang", "result", "first token", "total")
    for item in sent:
        found = answers.get(item.event_id)
        if not found:
            missing += 1
            summary.add_row(item.document_id, "", "", "[red]no answer[/red]", "", "")
            continue
        answer = found[0]
        if isinstance(answer, AnalysisEvent):
            console.print(render_event(answer))
            t = answer.timings
            summary.add_row(
                answer.document_id,
                answer.kind,
                answer.language.value,
                "[green]analysis[/green]",
                f"{t.time_to_first_token_ms / 1000:.1f} s",
                f"{t.total_ms / 1000:.1f} s",
            )
        else:
            missing += 1
            console.print(render_dead_letter(answer))
            summary.add_row(
                item.document_id, "", "", f"[red]dead letter: {answer.error_type.value}[/red]", "", ""
            )
    console.print(summary)
    console.print(
        f"{len(sent) - missing}/{len(sent)} analysed in {elapsed:.1f} s "
        f"(whole demo {time.perf_counter() - started:.1f} s)"
    )
    return 1 if missing else 0
