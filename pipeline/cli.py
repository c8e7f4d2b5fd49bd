"""`deepanalyze`: broker, run, publish, tail, prepare-model, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path

from aiokafka.errors import KafkaError
from rich.console import Console

from engine import EngineError, ModelLoadError
from pipeline.logs import setup_logging
from pipeline.settings import Settings, SettingsError, load_settings
from schemas import AnalysisEvent, DocumentKind

log = logging.getLogger("deepanalyze")


async def _run(settings: Settings) -> None:
    from pipeline.app import serve
    from pipeline.workers import stop_on_signals

    stop = stop_on_signals()
    await serve(settings, stop)


async def _broker(port: int, data: Path | None) -> None:
    from pipeline.broker import embedded_broker
    from pipeline.workers import stop_on_signals

    stop = stop_on_signals()
    with embedded_broker(port=port, folder=data) as broker:
        where = (
            f"data in {data}"
            if data is not None and broker.durable
            else "data in a temporary folder, removed on exit"
            if broker.durable
            else "in memory"
        )
        Console(stderr=True).print(
            f"{broker.kind} on {broker.bootstrap_servers} ({where}; Ctrl-C stops it)", highlight=False
        )
        await stop.wait()


async def _publish(settings: Settings, paths: list[Path], kind: DocumentKind | None) -> None:
    from pipeline.client import load_documents, publish_documents
    from schemas import DocumentEvent

    if paths == [Path("-")]:
        documents = [DocumentEvent(kind=kind, text=sys.stdin.read())]
    else:
        documents = load_documents(paths, kind)
    for sent in await publish_documents(settings, documents):
        print(f"{sent.document_id}\t{sent.topic}[{sent.partition}]@{sent.offset}\tevent_id={sent.event_id}")


async def _tail(settings: Settings, count: int | None, timeout_s: float, as_json: bool) -> None:
    from pipeline.client import collect_answers, dump_answer
    from pipeline.report import render_dead_letter, render_event

    console = Console()
    answers = await collect_answers(settings, None, timeout_s, count=count)
    for found in answers.values():
        for answer in found:
            if as_json:
                print(dump_answer(answer))
            elif isinstance(answer, AnalysisEvent):
                console.print(render_event(answer))
            else:
                console.print(render_dead_letter(answer))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepanalyze", description="A private text analyst on a message bus."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run a worker: consume documents, publish analyses (configured by the environment)"
    )
    run.add_argument(
        "--workers", type=int, default=1, help="worker processes in the consumer group (each its own engine)"
    )
    broker = sub.add_parser(
        "broker",
        help="run a one-node Apache Kafka (KRaft) on 127.0.0.1 (the Tansu emulator without Java or the jars)",
    )
    broker.add_argument("--port", type=int, default=9092)
    broker.add_argument(
        "--data", type=Path, default=None, help="keep Kafka's data in this folder (default: a temporary one)"
    )
    publish = sub.add_parser("publish", help="publish files, folders or stdin (-) as documents")
    publish.add_argument("paths", nargs="+", type=Path)
    publish.add_argument(
        "--kind", choices=[k.value for k in DocumentKind], help="override the documents' kind"
    )
    tail = sub.add_parser("tail", help="print analysis events and dead letters, from the beginning")
    tail.add_argument("--count", type=int, default=None, help="stop after this many")
    tail.add_argument("--timeout", type=float, default=10.0, help="stop after this many seconds")
    tail.add_argument("--json", action="store_true", help="print raw JSON")
    sub.add_parser("prepare-model", help="reassemble, verify and convert the default model (cached)")
    demo = sub.add_parser("demo", help="embedded broker + default model + the bundled samples, end to end")
    demo.add_argument("--timeout", type=float, default=900.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)  # errors stay on one greppable line
    try:
        settings = load_settings()
    except SettingsError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    setup_logging(settings.log_level)
    try:
        if args.command == "run" and args.workers > 1:
            from pipeline.workers import supervise

            return asyncio.run(supervise(args.workers))
        if args.command == "run":
            asyncio.run(_run(settings))
        elif args.command == "broker":
            asyncio.run(_broker(args.port, args.data))
        elif args.command == "publish":
            asyncio.run(_publish(settings, args.paths, DocumentKind(args.kind) if args.kind else None))
        elif args.command == "tail":
            asyncio.run(_tail(settings, args.count, args.timeout, args.json))
        elif args.command == "prepare-model":
            from pipeline.app import resolve_model_path

            print(resolve_model_path(settings))
        elif args.command == "demo":
            from pipeline.demo import run_demo

            return asyncio.run(run_demo(Console(), args.timeout))
    except (ModelLoadError, EngineError) as exc:
        console.print(f"[red]model error:[/red] {exc}", highlight=False)
        return 3
    except KafkaError as exc:
        console.print(f"[red]Kafka error ({settings.kafka_bootstrap_servers}):[/red] {exc}", highlight=False)
        return 4
    except (ValueError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
