"""The OpenAI-compatible backend against a scripted HTTP server (httpx's MockTransport): what it
sends, how it reads answers and logprobs, what it retries, how many requests it keeps open. The
same backend against a real llama.cpp server: tests/test_openai_server.py."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from engine import EngineError, SamplingParams
from pipeline.openai_backend import OpenAIBackend, option_logprobs, transient
from pipeline.settings import SettingsError, load_settings

Handler = Callable[[httpx.Request], httpx.Response]
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def backend(
    handler: Handler, *, concurrency: int = 4, retries: int = 2, json_schema: bool = True
) -> OpenAIBackend:
    client = openai.AsyncOpenAI(
        base_url="http://model.test/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    return OpenAIBackend(
        client, model=None, concurrency=concurrency, retries=retries, json_schema=json_schema, backoff_s=0.01
    )


def models() -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": [{"id": "served-model", "object": "model"}]})


def chunk(content: str | None = None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choices = [] if usage else [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
    body: dict[str, Any] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": choices,
    }
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def streamed(*parts: str, usage: tuple[int, int] | None = (40, 3)) -> httpx.Response:
    events = [chunk(p) for p in parts] + [chunk(finish="stop")]
    if usage:
        events.append(
            chunk(
                usage={"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
            )
        )
    return httpx.Response(
        200, text="".join(events) + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
    )


def logprobs(top: dict[str, float]) -> httpx.Response:
    first = max(top, key=top.__getitem__)
    entries = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top.items()]
    choice = {
        "index": 0,
        "finish_reason": "length",
        "message": {"role": "assistant", "content": first},
        "logprobs": {
            "content": [{"token": first, "logprob": top[first], "bytes": None, "top_logprobs": entries}]
        },
    }
    return httpx.Response(
        200, json={"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    )


async def test_start_takes_the_first_listed_model_and_a_generation_streams_with_the_schema() -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        sent.append(json.loads(request.content))
        return streamed('{"a"', ": 1}")

    async with backend(handler) as server:
        assert server.model_id == "served-model"
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
        pieces: list[str] = []
        result = await server.generate(
            MESSAGES, SamplingParams(max_new_tokens=64, json_schema=schema), pieces.append
        )
    assert result.text == '{"a": 1}' and result.prompt_tokens == 40 and result.output_tokens == 3
    assert pieces == ['{"a"', ": 1}"]  # each piece as it streams in
    assert result.finish_reason == "stop" and 0 <= result.queued_s <= result.ttft_s <= result.total_s
    body = sent[0]
    assert body["model"] == "served-model" and body["messages"] == MESSAGES and body["max_tokens"] == 64
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == json.loads(schema)


async def test_without_json_schema_support_no_response_format_is_sent_and_tokens_are_counted_by_chunk() -> (
    None
):
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        sent.append(json.loads(request.content))
        return streamed("one", " two", usage=None)  # a server that sends no usage

    async with backend(handler, json_schema=False) as server:
        result = await server.generate(MESSAGES, SamplingParams(json_schema='{"type": "object"}'))
    assert "response_format" not in sent[0] and result.output_tokens == 2 and result.text == "one two"


async def test_labels_are_scored_from_the_first_token_s_top_logprobs() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        body = json.loads(request.content)
        assert body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 20
        return logprobs({"负面": -0.6, "正面": -1.2, "正": -3.9, "\n": -5.0})

    async with backend(handler) as server:
        scores = await server.score(MESSAGES, ["正面", "负面"])
    assert scores[0] == pytest.approx(math.log(math.exp(-1.2) + math.exp(-3.9)))
    assert scores[1] == pytest.approx(-0.6)


def test_option_scores_share_a_token_that_begins_several_and_bound_the_unseen() -> None:
    top = {"p": math.log(0.2), "negative": math.log(0.5), "yes,": math.log(0.1)}
    scores = [math.exp(s) for s in option_logprobs(top, ["positive", "privacy", "negative", "yes", "other"])]
    assert scores[0] == pytest.approx(0.1) and scores[1] == pytest.approx(0.1)  # "p" split between two
    assert scores[2] == pytest.approx(0.5) and scores[3] == pytest.approx(0.1)  # "yes," begins with yes
    # "other" is not among them: at most what the list leaves (0.2) and at most the least likely (0.1)
    assert 0 < scores[4] <= 0.1 + 1e-9


async def test_transient_failures_are_retried_and_others_fail_at_once_as_engine_errors() -> None:
    calls = {"n": 0}
    status = {"code": 503}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        calls["n"] += 1
        if calls["n"] <= 2:
            return httpx.Response(status["code"], json={"error": {"message": "busy"}})
        return streamed("ok")

    async with backend(handler, retries=2) as server:
        assert (await server.generate(MESSAGES)).text == "ok" and calls["n"] == 3  # 503, 503, answered
        calls["n"], status["code"] = 0, 400
        with pytest.raises(EngineError, match="failed the request"):
            await server.generate(MESSAGES)
        assert calls["n"] == 1  # a bad request is not retried
        calls["n"], status["code"] = -5, 429  # more refusals than retries
        with pytest.raises(EngineError):
            await server.generate(MESSAGES)
        assert calls["n"] == -2  # 1 + 2 retries
    assert transient(openai.APIConnectionError(request=httpx.Request("GET", "http://x")))


async def test_no_more_requests_are_open_than_the_bound() -> None:
    open_now = {"n": 0, "most": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        open_now["n"] += 1
        open_now["most"] = max(open_now["most"], open_now["n"])
        await asyncio.sleep(0.02)
        open_now["n"] -= 1
        return logprobs({"yes": -0.1, "no": -2.5})

    async with backend(handler, concurrency=3) as server:  # type: ignore[arg-type]
        await asyncio.gather(*(server.score(MESSAGES, ["yes", "no"]) for _ in range(12)))
        stats = server.stats()
    assert open_now["most"] == 3
    assert stats.num_steps == 12 and stats.num_finished == 12 and stats.num_running == 0


async def test_a_server_without_logprobs_is_a_clear_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return models()
        message = {"role": "assistant", "content": "yes"}
        choice = {"index": 0, "finish_reason": "length", "message": message, "logprobs": None}
        return httpx.Response(
            200,
            json={"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]},
        )

    async with backend(handler) as server:
        with pytest.raises(EngineError, match="top_logprobs"):
            await server.score(MESSAGES, ["yes", "no"])


def test_the_openai_backend_needs_a_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANALYZER_BACKEND", "openai")
    with pytest.raises(SettingsError, match="OPENAI_BASE_URL"):
        load_settings()
    monkeypatch.setenv("OPENAI_BASE_URL", "127.0.0.1:8080")
    with pytest.raises(SettingsError, match="http"):
        load_settings()
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1")
    assert load_settings().openai_base_url == "http://127.0.0.1:8080/v1"
