"""ANALYZER_BACKEND=openai against a real OpenAI-compatible server: llama.cpp's llama-server
(`make llama-server` builds it once from the pinned llama-cpp-python sdist; `make test` does) on
the bundled model's own GGUF. The labels it scores agree with the embedded engine's on the same
weights, and the worker (`pipeline.app.serve`) answers documents through it end to end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import Engine
from pipeline.analyzer import Analyzer
from pipeline.app import resolve_model_path, serve
from pipeline.backends import EmbeddedBackend
from pipeline.bundled_models import DEFAULT_MODEL, bundled_gguf
from pipeline.client import collect_answers, load_documents, publish_documents
from pipeline.demo import sample_paths
from pipeline.kafka import ensure_topics
from pipeline.labels import probabilities
from pipeline.openai_backend import OpenAIBackend
from pipeline.service import Service
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry
from prompts.render import detect_language
from schemas import AnalysisEvent, DocumentKind

pytestmark = [pytest.mark.integration, pytest.mark.model]

ALIAS = "qwen2.5-coder-0.5b-instruct-q4_k_m"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
BUILT = CACHE / "deepanalyze" / "llama-server-0.3.36" / "bin" / "llama-server"  # by `make llama-server`
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or BUILT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _exit_reason(code: int) -> str:
    """'killed by SIGILL' for a signal (Popen's negative code), else 'exited with N'."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server on the default model's GGUF; yields its API root (…/v1)."""
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"no llama-server at {LLAMA_SERVER}: `make llama-server` builds it (make test does)")
    gguf = bundled_gguf(DEFAULT_MODEL, Settings().model_cache_dir)
    port = _free_port()
    command = [
        str(LLAMA_SERVER),
        "-m",
        str(gguf),
        "--alias",
        ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += ["-c", "32768", "-np", "4", "-t", str(os.cpu_count() or 2), "--no-webui"]
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            code = process.poll()
            if code is not None or time.monotonic() > deadline:
                how = "not ready within 180 s" if code is None else _exit_reason(code)
                pytest.fail(f"llama-server did not start ({how}): {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
async def server(llama_server: str) -> AsyncIterator[OpenAIBackend]:
    settings = Settings(analyzer_backend="openai", openai_base_url=llama_server, max_inflight=4)
    async with OpenAIBackend.from_settings(settings) as backend:
        yield backend


async def test_the_server_s_labels_agree_with_the_embedded_engine_on_the_same_weights(
    server: OpenAIBackend,
) -> None:
    assert server.model_id == ALIAS  # the first (only) model the server lists
    settings = Settings()
    engine = await asyncio.to_thread(Engine.from_config, settings.engine_config(resolve_model_path(settings)))
    documents = load_documents(sample_paths())[:6]
    pairs = []
    async with engine:
        ours = Analyzer(EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=64, attempts=1)
        theirs = Analyzer(server, trace.NoOpTracer(), max_new_tokens=64, attempts=1)
        for document in documents:
            language = document.language or detect_language(document.text)
            a = await ours.scores(document.kind, language, document.text)
            b = await theirs.scores(document.kind, language, document.text)
            for name in ("polarity", "attitude", "doubt", "expectation"):
                p, q = probabilities(a.logprobs[name], None), probabilities(b.logprobs[name], None)
                pairs.append((p[0], q[0]))
    # Same weights (Q4_K_M), different arithmetic (our bf16 vs llama.cpp's quantised dot products)
    # and the server's scores sum every first token that begins an answer: close, not equal.
    # The same choice wherever either is not a near tie.
    assert all(abs(p - q) < 0.1 for p, q in pairs), pairs
    assert all((p > 0.5) == (q > 0.5) for p, q in pairs if max(abs(p - 0.5), abs(q - 0.5)) > 0.1), pairs


async def test_the_worker_answers_documents_through_the_server(
    llama_server: str, settings: Settings, span_exporter: InMemorySpanExporter, telemetry: Telemetry
) -> None:
    settings = Settings(
        **{
            **settings.model_dump(),
            "analyzer_backend": "openai",
            "openai_base_url": llama_server,
            "max_inflight": 8,
        }
    )
    wanted = {"sample-complaint-zh", "sample-complaint-en", "sample-filing-en"}
    documents = [d for d in load_documents(sample_paths()) if d.document_id in wanted]
    await ensure_topics(settings)
    sent = await publish_documents(settings, documents)
    stop, ready = asyncio.Event(), asyncio.Event()

    def on_ready(service: Service, port: int) -> None:
        ready.set()

    worker = asyncio.create_task(serve(settings, stop, telemetry=telemetry, on_ready=on_ready))
    try:
        answers = await collect_answers(settings, {s.event_id for s in sent}, timeout_s=600)
    finally:
        stop.set()
        await worker
    assert ready.is_set() and {s.event_id for s in sent} <= answers.keys()
    for found in answers.values():
        event = found[0]
        assert isinstance(event, AnalysisEvent), event
        assert event.model == ALIAS and event.analysis.core_viewpoint
        assert (event.kind == DocumentKind.COMPLAINT) == (event.analysis.triage is not None)
        assert event.timings.output_tokens > 0
    chats = [s for s in span_exporter.get_finished_spans() if s.name == f"chat {ALIAS}"]
    assert chats and all(s.attributes and s.attributes["gen_ai.provider.name"] == "openai" for s in chats)
