"""The peers benchmark's client and report (no server or model needed): tokens and first-token
times as each server's streaming format reports them; ratios taken within rounds."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest
from rich.console import Console

from bench.peers import (
    Result,
    Server,
    _one,
    is_ours,
    ours_defer,
    ours_draft_step_tokens,
    ours_drafts,
    ours_kernel,
    ours_saturated,
    ours_step,
    report,
)


def _sse(chunks: list[dict[str, object]], done: bool) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _ask(server: Server, body: bytes) -> tuple[int, float, float]:
    seen: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> tuple[int, float, float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await _one(client, server, [1, 2, 3], 3, 0.0, 0.0)

    tokens, latency, ttft = asyncio.run(go())
    assert seen[0]["prompt"] == [1, 2, 3] and seen[0]["ignore_eos"] is True  # token ids, EOS ignored
    return tokens, latency, ttft


def test_vllm_tokens_come_from_the_usage_chunk() -> None:
    server = Server("vllm", [], {}, "http://peer", "/v1/completions", "")
    chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "c")] + [
        {"choices": [], "usage": {"completion_tokens": 3}}
    ]
    tokens, latency, ttft = _ask(server, _sse(chunks, done=True))
    assert tokens == 3 and 0 <= ttft <= latency


def test_llama_tokens_come_from_the_final_timings() -> None:
    server = Server("llama", [], {}, "http://peer", "/completion", "")
    chunks: list[dict[str, object]] = [{"content": t, "stop": False} for t in ("a", "b")]
    chunks.append({"content": "c", "stop": True, "timings": {"predicted_n": 3}})
    tokens, latency, ttft = _ask(server, _sse(chunks, done=False))
    assert tokens == 3 and 0 <= ttft <= latency


def test_ratios_are_taken_within_each_round_then_the_median() -> None:
    def result(system: str, round_: int, tok_s: float) -> Result:
        return Result(system, "burst", round_, 10.0, [int(tok_s * 10)], [5.0], [1.0], 100.0)

    # our speed and the peer's drift together from round to round; the ratio stays 0.5
    results = [result("ours", i, 10.0 * (i + 1)) for i in range(3)]
    results += [result("vllm", i, 20.0 * (i + 1)) for i in range(3)]
    args = argparse.Namespace(scenarios="burst", docs=1, new_tokens=1, rounds=3)
    summary = report(results, ["ours", "vllm"], args, Console(file=None, quiet=True))
    assert summary["ratios"]["burst: ours / vllm tok/s"] == {"rounds": [0.5, 0.5, 0.5], "median": 0.5}
    assert summary["medians"]["vllm/burst"]["tok_s"] == 40.0


def test_our_engine_at_another_step_size_is_compared_with_each_peer_and_with_the_default() -> None:
    def result(system: str, round_: int, tok_s: float) -> Result:
        return Result(system, "burst", round_, 10.0, [int(tok_s * 10)], [5.0], [1.0], 100.0)

    results = [result("ours", i, 10.0) for i in range(3)] + [result("ours@512", i, 12.0) for i in range(3)]
    results += [result("vllm", i, 15.0) for i in range(3)]
    args = argparse.Namespace(scenarios="burst", docs=1, new_tokens=1, rounds=3)
    ratios = report(results, ["ours", "ours@512", "vllm"], args, Console(file=None, quiet=True))["ratios"]
    assert ratios["burst: ours / vllm tok/s"]["median"] == pytest.approx(10 / 15)
    assert ratios["burst: ours@512 / vllm tok/s"]["median"] == pytest.approx(12 / 15)
    assert ratios["burst: ours@512 / ours tok/s"]["median"] == pytest.approx(1.2)
    assert not any(name.startswith("burst: ours / ours@") for name in ratios)
    assert is_ours("ours@512") and is_ours("ours") and not is_ours("vllm") and not is_ours("ours@")
    assert is_ours("ours:torch") and is_ours("ours@512:torch") and not is_ours("ours:cuda")
    assert (ours_step("ours@512:torch"), ours_kernel("ours@512:torch")) == ("512", "torch")
    assert (ours_step("ours:torch"), ours_kernel("ours")) == (None, None)
    assert (ours_step("ours@512~16:torch"), ours_defer("ours@512~16:torch")) == ("512", "16")
    assert ours_kernel("ours@512~16:torch") == "torch" and ours_defer("ours@512:torch") is None
    assert is_ours("ours~16") and not is_ours("ours~") and not is_ours("ours:torch~16")
    assert (ours_saturated("ours^384"), ours_step("ours^384"), ours_saturated("ours@192")) == (
        "384",
        None,
        None,
    )
    assert [f("ours@192^384~16:torch") for f in (ours_step, ours_saturated, ours_defer, ours_kernel)] == [
        "192",
        "384",
        "16",
        "torch",
    ]
    assert not is_ours("ours^") and not is_ours("ours~16^384")
    five = "ours@192^384~16+8:torch"
    assert [f(five) for f in (ours_step, ours_saturated, ours_defer, ours_drafts, ours_kernel)] == [
        "192",
        "384",
        "16",
        "8",
        "torch",
    ]
    assert (ours_drafts("ours+0"), ours_drafts("ours~16"), is_ours("ours+")) == ("0", None, False)
    unshared = (ours_drafts("ours+4!"), ours_draft_step_tokens("ours+4!"), ours_draft_step_tokens("ours+4"))
    assert unshared == ("4", "0", None), "ours+N!: SPECULATIVE_STEP_TOKENS=0"
    shared = (ours_drafts("ours+4/64"), ours_draft_step_tokens("ours+4/64:torch"), is_ours("ours+4/"))
    assert shared == ("4", "64", False), "ours+N/T: SPECULATIVE_STEP_TOKENS=T"
    assert (ours_draft_step_tokens("ours+4!:torch"), ours_kernel("ours+4!:torch"), is_ours("ours!")) == (
        "0",
        "torch",
        False,
    )
