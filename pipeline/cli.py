"""`deepanalyze`: broker, run, publish, tail, prepare-model, demo.

Imports that load torch or the Kafka client wait until a command needs them, so that `--help`
and `--version` answer at once."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

from rich.console import Console

from pipeline.logs import setup_logging
from pipeline.settings import Settings, SettingsError, load_settings, unknown_variables

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


@dataclasses.dataclass(frozen=True)
class PublishOptions:
    kind: str | None
    lines: bool
    topic: str | None
    key: bytes | None
    headers: list[tuple[str, bytes]]


def _header(text: str) -> tuple[str, bytes]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a header is NAME=VALUE, got {text!r}")
    return name, value.encode("utf-8")


async def _publish(settings: Settings, paths: list[Path], options: PublishOptions) -> None:
    from pipeline.client import documents_from_lines, load_documents, publish_documents
    from schemas import DocumentEvent

    if paths == [Path("-")]:
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("standard input was empty: nothing to publish")
        documents = (
            documents_from_lines(text, "stdin", options.kind)
            if options.lines
            else [DocumentEvent(kind=options.kind, text=text)]
        )
    else:
        documents = load_documents(paths, options.kind, lines=options.lines)
    if not documents:
        raise ValueError("no documents found in " + ", ".join(map(str, paths)))
    kindless = [d.document_id or "stdin" for d in documents if d.kind is None]
    if kindless and options.topic is None:
        shown = ", ".join(kindless[:3]) + (f" and {len(kindless) - 3} more" if len(kindless) > 3 else "")
        raise ValueError(
            f"plain text has no kind ({shown}): pass --kind "
            + "|".join(settings.kinds)
            + ", or --topic for the topic it belongs on"
        )
    from pipeline.telemetry import setup_telemetry

    telemetry = setup_telemetry(settings)  # exports the documents' `send` spans where OTLP is set up
    try:
        sent = await publish_documents(
            settings, documents, topic=options.topic, key=options.key, headers=options.headers,
            tracer=telemetry.tracer,
        )  # fmt: skip
    finally:
        await asyncio.to_thread(telemetry.shutdown)
    for s in sent:
        print(f"{s.document_id}\t{s.topic}[{s.partition}]@{s.offset}\tevent_id={s.event_id}")


async def _tail(
    settings: Settings, count: int | None, timeout_s: float | None, as_json: bool, from_beginning: bool
) -> None:
    from pipeline.client import dump_answer, follow_answers
    from pipeline.report import render_dead_letter, render_event
    from schemas import AnalysisEvent

    console = Console()
    where = f"{settings.topic_analysis}, {settings.topic_dead_letters}"
    start = "from the beginning" if from_beginning else "from now on"
    notice = Console(stderr=True, highlight=False)
    answers = follow_answers(
        settings, from_beginning=from_beginning, count=count, timeout_s=timeout_s,
        on_ready=lambda: notice.print(f"% reading {where} {start}"),
    )  # fmt: skip
    async with contextlib.aclosing(answers):
        async for answer in answers:
            if as_json:
                print(dump_answer(answer), flush=True)
            elif isinstance(answer, AnalysisEvent):
                console.print(render_event(answer))
            else:
                console.print(render_dead_letter(answer))


def _version() -> str:
    try:
        return importlib.metadata.version("deepanalyze")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepanalyze", description="A private text analyst on a message bus."
    )
    parser.add_argument("--version", action="version", version=f"deepanalyze {_version()}")
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
    publish = sub.add_parser(
        "publish",
        help="publish files, folders or stdin (-) as documents",
        description="*.json files are DocumentEvents; other files are plain text, which needs --kind "
        "(or --topic). With --lines every line is a document.",
    )
    publish.add_argument("paths", nargs="+", type=Path)
    publish.add_argument(
        "--kind",
        help="the documents' kind (overrides their own): complaint, meeting_notes, filing, or KINDS_FILE's",
    )
    publish.add_argument(
        "--lines", action="store_true", help="one document per line (text, or JSON from '{')"
    )
    publish.add_argument("--topic", help="publish to this topic instead of the kind's input topic")
    publish.add_argument("--key", help="the records' key (default: each document's id)")
    publish.add_argument(
        "--header", type=_header, action="append", default=[], metavar="NAME=VALUE",
        help="a record header, added to the document's own (repeatable)",
    )  # fmt: skip
    tail = sub.add_parser("tail", help="print analysis events and dead letters as they arrive (Ctrl-C stops)")
    tail.add_argument("--from-beginning", action="store_true", help="start at the topics' beginning")
    tail.add_argument("--count", type=int, default=None, help="stop after exactly this many")
    tail.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    sub.add_parser("prepare-model", help="reassemble, verify and convert the default model (cached)")
    demo = sub.add_parser("demo", help="embedded broker + default model + the bundled samples, end to end")
    demo.add_argument("--timeout", type=float, default=900.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from aiokafka.errors import KafkaError

    from engine import EngineError, ModelLoadError

    console = Console(stderr=True, soft_wrap=True)  # errors stay on one greppable line
    try:
        settings = load_settings()
    except SettingsError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    for warning in unknown_variables(os.environ):
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
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
            kind = args.kind
            if kind is not None and kind not in settings.kinds:
                console.print(f"[red]unknown kind {kind!r}: one of {', '.join(settings.kinds)}[/red]")
                return 2
            key = args.key.encode("utf-8") if args.key is not None else None
            options = PublishOptions(kind, args.lines, args.topic, key, args.header)
            asyncio.run(_publish(settings, args.paths, options))
        elif args.command == "tail":
            asyncio.run(_tail(settings, args.count, args.timeout, args.json, args.from_beginning))
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
