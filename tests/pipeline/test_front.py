"""The front end's API over the real path: POST /api/analyze publishes to the session's Kafka, a
service with the scripted stand-in engine answers (these tests are about the HTTP contract, not
the model), and the answer is read back from the answer topics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from aiokafka.structs import TopicPartition

from pipeline.answers import AnswerHub
from pipeline.client import collect_answers, publish_documents
from pipeline.front import Front, router
from pipeline.http import serve_status
from pipeline.kafka import admin_client, ensure_topics, make_consumer, partitions_of
from pipeline.service import Service, running
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry
from schemas import AnalysisEvent, AnalysisProgress, DocumentEvent
from tests.pipeline.fakes import ScriptedEngine

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def front_end(
    settings: Settings,
    telemetry: Telemetry,
    *,
    worker: bool = True,
    reachable: Callable[[], bool | None] | None = None,
    engine: ScriptedEngine | None = None,
) -> AsyncIterator[str]:
    """The HTTP server with the pages' router, and (unless `worker` is False) a service answering;
    the pages learn whether the broker is reachable from the service (or from `reachable`)."""
    hub = AnswerHub(settings)
    service = Service(settings, engine or ScriptedEngine(delay_s=0.05), telemetry)
    front = Front(settings, hub, send_timeout_s=3.0, broker_reachable=reachable or service.broker_reachable)
    stop = asyncio.Event()
    # Topics first: a POST that beats the worker's start-up would otherwise have the broker
    # auto-create the topic with its own default partition count.
    await ensure_topics(settings)
    async with contextlib.AsyncExitStack() as stack:
        if worker:
            await stack.enter_async_context(running(service, stop))
        port = await stack.enter_async_context(
            serve_status(service.status, "127.0.0.1", 0, None, router(front))
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await hub.close()
            await front.close()


async def test_analyze_publishes_and_returns_the_analysis_event_from_the_answer_topic(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry) as url, httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"{url}/api/analyze", json={"text": "快递晚到了五天，客服不回复。", "kind": "complaint"}
        )
        assert response.status_code == 200, response.text
        event = AnalysisEvent.model_validate(response.json())
        assert event.source.topic == settings.topic_complaints
        assert event.language.value == "zh" and event.analysis.triage is not None
        assert event.document_id.startswith("web-")


async def test_an_accepted_document_is_followed_on_the_event_stream_and_replayed_after_reconnect(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry) as url, httpx.AsyncClient(timeout=60) as client:
        accepted = await client.post(
            f"{url}/api/analyze",
            json={"text": "Minutes: ship on Friday.", "kind": "meeting_notes", "wait": False},
        )
        assert accepted.status_code == 202
        event_id = accepted.json()["event_id"]
        own = await _events(client, f"{url}/api/events?event_id={event_id}", 1)
        assert [(kind, data["event_id"]) for _, kind, data in own] == [("analysis", event_id)]
        second = await client.post(
            f"{url}/api/analyze", json={"text": "Refund me. MODEL-FAIL", "wait": False}
        )
        letter = await _events(client, f"{url}/api/events?event_id={second.json()['event_id']}", 1)
        assert letter[0][1] == "dead_letter"
        # A board that saw the first answer reconnects with Last-Event-ID: it gets only what followed.
        replayed = await _events(client, f"{url}/api/events?replay=10", 2)
        assert [data["event_id"] for _, _, data in replayed] == [event_id, second.json()["event_id"]]
        after_first = await _events(client, f"{url}/api/events", 1, headers={"Last-Event-ID": replayed[0][0]})
        assert [data["event_id"] for _, _, data in after_first] == [second.json()["event_id"]]


async def test_a_dead_lettered_document_is_a_502_with_the_reason(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry) as url, httpx.AsyncClient(timeout=60) as client:
        response = await client.post(f"{url}/api/analyze", json={"text": "The model breaks here: MODEL-FAIL"})
    assert response.status_code == 502
    body = response.json()
    assert (
        body["error"] == "analysis_failed" and body["reason"] == "model_output_invalid" and body["event_id"]
    )


async def test_the_pages_offer_the_configured_kinds_and_refuse_others_as_a_422(
    settings: Settings, telemetry: Telemetry, tmp_path: Path
) -> None:
    path = tmp_path / "kinds.toml"
    path.write_text("[kinds.support_ticket]\ntitle = { zh = '技术支持工单', en = 'support ticket' }\n")
    settings = Settings(**{**settings.model_dump(), "kinds_file": path})
    async with front_end(settings, telemetry, worker=False) as url, httpx.AsyncClient(timeout=30) as client:
        kinds = (await client.get(f"{url}/api/kinds")).json()
        refused = await client.post(
            f"{url}/api/analyze", json={"text": "x", "kind": "invoice", "wait": False}
        )
    assert [k["name"] for k in kinds] == ["complaint", "meeting_notes", "filing", "support_ticket"]
    assert kinds[3]["title"] == {"zh": "技术支持工单", "en": "support ticket"} and not kinds[3]["triage"]
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "kind"]


async def test_the_page_s_document_is_followed_as_it_is_written_and_no_other_is(
    settings: Settings, telemetry: Telemetry
) -> None:
    engine = ScriptedEngine(piece_delay_s=0.02)
    async with front_end(settings, telemetry, engine=engine) as url, httpx.AsyncClient(timeout=60) as client:
        plain = (
            await publish_documents(settings, [DocumentEvent(document_id="plain", text="洗衣机漏水。")])
        )[0]
        accepted = (
            await client.post(f"{url}/api/analyze", json={"text": "快递晚到了五天。", "wait": False})
        ).json()
        events: list[tuple[str, str]] = []
        async with client.stream(
            "GET", f"{url}/api/events", params={"event_id": accepted["event_id"]}
        ) as stream:
            name = ""
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    events.append((name, line.removeprefix("data: ")))
        await collect_answers(settings, {plain.event_id}, timeout_s=30)
        progress = await read_topic(settings, settings.topic_progress, wait_s=2.0)
    names = [n for n, _ in events]
    assert names[-1] == "analysis" and names.count("partial") >= 2, names
    partials = [AnalysisProgress.model_validate_json(d) for n, d in events if n == "partial"]
    assert all(p.event_id == accepted["event_id"] for p in partials)
    assert [p.seq for p in partials] == sorted({p.seq for p in partials})  # newest only, in order
    final = AnalysisEvent.model_validate_json(events[-1][1])
    assert partials[-1].analysis["core_viewpoint"] == final.analysis.core_viewpoint
    assert {json.loads(v)["event_id"] for v in progress} == {accepted["event_id"]}  # none for `plain`


async def test_too_long_input_is_a_413_and_nothing_is_published(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry) as url, httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"{url}/api/analyze", json={"text": "长" * (settings.max_document_chars + 1)}
        )
        assert response.status_code == 413
        body = response.json()
        assert body["error"] == "too_long" and str(settings.max_document_chars) in body["detail"]
        assert "Shorten it" in body["detail"]
        replay = await _events(client, f"{url}/api/events?replay=10", 0, wait_s=1.0)
    assert replay == []


async def test_no_answer_within_the_timeout_is_a_504_naming_the_event_to_follow(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry, worker=False) as url, httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"{url}/api/analyze", json={"text": "Nobody is consuming.", "timeout_s": 1.0}
        )
    assert response.status_code == 504
    body = response.json()
    assert body["error"] == "timeout" and body["event_id"] in body["detail"]


async def test_a_broker_that_cannot_be_reached_is_a_503(settings: Settings, telemetry: Telemetry) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once the socket closes
    down = Settings(**{**settings.model_dump(), "kafka_bootstrap_servers": dead})
    front = Front(down, AnswerHub(down), send_timeout_s=2.0)
    app = serve_status(lambda: {}, "127.0.0.1", 0, None, router(front))
    async with app as port, httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"http://127.0.0.1:{port}/api/analyze", json={"text": "hello"})
    await front.close()
    assert response.status_code == 503
    body = response.json()
    assert body["error"] == "broker_unavailable" and "Try again" in body["detail"]
    assert dead not in body["detail"] and "Error" not in body["detail"]  # what to do, not the internals


async def test_the_pages_and_their_assets_are_served_locally(
    settings: Settings, telemetry: Telemetry
) -> None:
    async with front_end(settings, telemetry, worker=False) as url, httpx.AsyncClient(timeout=30) as client:
        for path in ("/", "/triage", "/static/style.css", "/static/analyze.js", "/static/triage.js"):
            response = await client.get(f"{url}{path}")
            assert response.status_code == 200, path
            assert "http://" not in response.text and "https://" not in response.text, (
                path
            )  # nothing external
        page = (await client.get(f"{url}/")).text
        assert "开始深度分析" in page and 'id="text"' in page and 'id="kind"' in page
        schema = (await client.get(f"{url}/openapi.json")).json()
    assert {"/api/analyze", "/api/events", "/api/status"} <= schema["paths"].keys()
    assert {"200", "202", "413", "502", "503", "504"} <= schema["paths"]["/api/analyze"]["post"][
        "responses"
    ].keys()


async def read_topic(settings: Settings, topic: str, wait_s: float) -> list[bytes]:
    """Every record value on `topic` from its beginning, read for `wait_s`."""
    consumer = make_consumer(settings, grouped=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in (await partitions_of(settings, [topic]))[topic]]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        values: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + wait_s
        while asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            values += [r.value or b"" for records in batch.values() for r in records]
        return values
    finally:
        await consumer.stop()


async def _events(
    client: httpx.AsyncClient,
    url: str,
    count: int,
    headers: dict[str, str] | None = None,
    wait_s: float = 30.0,
) -> list[tuple[str, str, dict[str, object]]]:
    """The first `count` answers on the server-sent events of `url` as (id, event, data), within `wait_s`."""
    found: list[tuple[str, str, dict[str, object]]] = []

    async def read() -> None:
        fields: dict[str, str] = {}
        async with client.stream("GET", url, headers=headers) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                # answers, not the live indicator nor an analysis as it is written
                if "data" in fields and fields.get("event") not in ("state", "partial"):
                    found.append((fields["id"], fields["event"], json.loads(fields["data"])))
                    if len(found) >= count:
                        return
                fields = {}

    if count == 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read(), wait_s)
        return found
    await asyncio.wait_for(read(), wait_s)
    return found


async def test_the_openapi_schema_holds_under_schemathesis(settings: Settings, telemetry: Telemetry) -> None:
    """Schema-driven requests to every operation (the endless event stream aside: its own tests
    above): no 5xx, and every response matches the schema in status, content type and body."""
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    async with front_end(settings, telemetry) as url:
        st = Path(sys.executable).with_name("st")
        proc = await asyncio.create_subprocess_exec(
            str(st), "run", f"{url}/openapi.json", "--checks", checks, "--exclude-path", "/api/events",
            "--max-examples", "30", "--seed", "7", "--request-timeout", "60",
            "--phases", "examples,coverage,fuzzing", "--no-color",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 600)
    report = out.decode(errors="replace")
    assert proc.returncode == 0, report[-4000:]
    assert "7 selected / 8 total" in report  # all but the stream: analyze, kinds, limits, status, 3 probes


async def test_two_requesters_each_get_their_own_analysis_across_a_re_created_topic(
    settings: Settings, telemetry: Telemetry
) -> None:
    """Offsets start again at 0 when a topic is re-created (or a memory-only broker restarts).
    Event ids were derived from topic/partition/offset alone and the hub kept the first answer per
    id: Bob's POST returned Alice's analysis, her card number in it. Now the id is bound to the
    record's timestamp and bytes, and the API only hands a requester the answer to the document
    it published."""
    settings = Settings(**{**settings.model_dump(), "topic_partitions": 1, "cluster_check_interval_s": 0.2})
    async with front_end(settings, telemetry) as url, httpx.AsyncClient(timeout=60) as client:
        alice = await client.post(
            f"{url}/api/analyze", json={"text": "Alice: my card 4111 1111 was charged twice."}
        )
        assert alice.status_code == 200, alice.text
        async with admin_client(settings) as admin:
            await admin.delete_topics([settings.topic_complaints])
        await asyncio.sleep(2.0)
        await ensure_topics(settings)  # the worker's watch may have created it again already
        bob = await client.post(f"{url}/api/analyze", json={"text": "Bob: the fridge arrived dented."})
    assert bob.status_code == 200, bob.text
    alice_event, bob_event = (
        AnalysisEvent.model_validate(alice.json()),
        AnalysisEvent.model_validate(bob.json()),
    )
    assert (alice_event.source.partition, alice_event.source.offset) == (bob_event.source.partition, 0)
    assert bob_event.source.offset == alice_event.source.offset  # the same coordinates, re-used
    assert bob_event.event_id != alice_event.event_id
    assert "Bob" in bob_event.analysis.core_viewpoint and "4111" not in bob.text


async def test_closing_the_hub_ends_every_open_event_stream(settings: Settings) -> None:
    """A worker that stops must not wait on a browser's board: the streams end with the hub."""
    hub = AnswerHub(settings)
    follow = hub.follow(None, 0, heartbeat_s=60.0)
    waiting = asyncio.create_task(hub.wait_for("no-such-event", 60.0))
    following = asyncio.create_task(anext(follow, "ended"))
    await asyncio.sleep(0.2)
    await asyncio.wait_for(hub.close(), 10)
    assert await asyncio.wait_for(waiting, 5) is None
    assert await asyncio.wait_for(following, 5) == "ended"
