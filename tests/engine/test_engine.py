"""The engine on tiny models built in code (fp32): batched output equals `model.generate` alone."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, EngineError, GenerationResult, SamplingParams
from engine.linear import pack_linears
from engine.loader import LoadedModel
from engine.scoring import distinguishing_length
from engine.selftest import recompute as reference
from engine.selftest import stock_attention
from engine.tiny import build_tiny

PROMPTS = [
    "hello there",
    "会议决定下季度增加预算，客户投诉处理时间缩短到两天。",
    "The customer complains that the delivery was late and the fee was wrong, again and again.",
    "x",
    "Revenue grew 12% year over year.",
]


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen2-packed"])
def tiny(request: pytest.FixtureRequest, test_device: torch.device) -> LoadedModel:
    """Each architecture as transformers builds it, and a Qwen2 whose linear weights and head are
    packed for oneDNN as the loader packs them on a CPU (every property holds for it too)."""
    architecture, _, packed = str(request.param).partition("-")
    loaded = build_tiny("llama" if architecture == "llama" else "qwen2", device=test_device)
    if packed and pack_linears(loaded.model, test_device, loaded.dtype) == 0:
        pytest.skip(f"nothing is packed on {test_device}")
    return loaded


def make_engine(tiny: LoadedModel, **overrides: object) -> Engine:
    options: dict[str, object] = {"kv_cache_bytes": 1 << 24, **overrides}
    config = EngineConfig(model_path=Path("unused"), dtype="float32", **options)  # type: ignore[arg-type]
    return Engine(config, tiny)


def generate_alone(tiny: LoadedModel, ids: list[int], n: int) -> list[int]:
    """`model.generate` on one request; the engine reports tokens before EOS, so EOS is cut."""
    with stock_attention(tiny):
        out = tiny.model.generate(torch.tensor([ids], device=tiny.device), max_new_tokens=n, do_sample=False)[
            0, len(ids) :
        ]
    tokens = [int(t) for t in out]
    eos = tiny.tokenizer.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("defer", [0, 3])
async def test_requests_joining_at_different_steps_with_chunked_prefill_match_alone(
    tiny: LoadedModel, defer: int
) -> None:
    # A budget of 8 tokens a step (16 while three or more requests are running or waiting: the
    # saturated budget, twice the other by default) forces every prompt (20-50 tokens) through
    # several chunks of both sizes, interleaved with the decodes of the requests already running
    # (or, deferred, between them).
    engine = make_engine(
        tiny, dynamic_batching=True, max_batch_size=3, dynamic_batch_window_ms=30, max_tokens_per_step=8,
        decode_defer_steps=defer,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    async with engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS]

        async def late(i: int) -> GenerationResult:
            await asyncio.sleep(0.02 * i)
            return await engine.generate(ids[i], params)

        results = await asyncio.gather(*(late(i) for i in range(len(ids))))
        stats = engine.stats()
    for prompt_ids, result in zip(ids, results, strict=True):
        assert result.token_ids == reference(tiny, prompt_ids, 10)
        assert result.finish_reason == "length"
        assert result.prompt_tokens == len(prompt_ids)
        assert 0 <= result.queued_s <= result.ttft_s <= result.total_s
    assert stats.largest_batch > 1, "requests should have shared steps"
    assert stats.largest_batch <= 3
    assert stats.num_finished == len(PROMPTS)
    assert stats.kv_used_bytes == 0, "every block returned"


async def test_prompts_sharing_a_prefix_reuse_its_blocks_and_match_alone(tiny: LoadedModel) -> None:
    system = "You analyse documents. Answer with one JSON object: viewpoint, facts, data, sentiment."
    engine = make_engine(
        tiny, dynamic_batching=True, max_batch_size=4, dynamic_batch_window_ms=0, max_tokens_per_step=16
    )
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    async with engine:
        ids = [
            engine.format_chat([{"role": "system", "content": system}, {"role": "user", "content": p}])
            for p in PROMPTS
        ]
        first = await engine.generate(ids[0], params)  # computes the shared prefix and registers it

        async def late(i: int) -> GenerationResult:
            await asyncio.sleep(0.01 * i)
            return await engine.generate(ids[i], params)

        rest = await asyncio.gather(*(late(i) for i in range(1, len(ids))))
        stats = engine.stats()
    common = next(n for n, column in enumerate(zip(*ids, strict=False)) if len(set(column)) > 1)
    shared = common // 16 * 16
    assert shared >= 32
    assert stats.prefix_hit_tokens >= shared * (len(PROMPTS) - 1)
    for prompt_ids, result in zip(ids, [first, *rest], strict=True):
        assert result.token_ids == reference(tiny, prompt_ids, 8)
    assert stats.kv_used_bytes == 0, "adopted blocks are released too"


async def test_preempted_requests_produce_the_same_output(tiny: LoadedModel) -> None:
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outputs = []
    for pool_bytes in (1 << 24, 12 * 16 * 512):  # roomy, then 12 blocks of 16 tokens for 5 requests
        engine = make_engine(tiny, dynamic_batching=True, max_batch_size=5, kv_cache_bytes=pool_bytes)
        async with engine:
            ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS]
            results = await asyncio.gather(*(engine.generate(i, params) for i in ids))
            outputs.append([r.token_ids for r in results])
            preemptions = engine.stats().num_preemptions
            assert engine.stats().kv_used_bytes == 0
    assert preemptions > 0, "the small pool should have forced preemption"
    assert outputs[0] == outputs[1]


async def test_kv_accounting_is_exact(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, kv_cache_bytes=1 << 20, block_size=16)
    stats = engine.stats()
    # tiny model: 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 (K and V) = 512 bytes a token
    assert stats.kv_bytes_per_token == 512
    assert stats.kv_total_bytes == (1 << 20) // (512 * 16) * 512 * 16
    assert stats.kv_total_bytes == engine.cache.total_bytes


@pytest.mark.parametrize("compression", [False, True])
async def test_the_default_pool_holds_the_batch_at_the_longest_request_and_no_more(
    tiny: LoadedModel, compression: bool
) -> None:
    # No KV_CACHE_BYTES: 3 sequences of 100 tokens (7 blocks of 16 each) can use 21 blocks; free
    # memory (gigabytes) no longer decides. Compressed, the quantised part holds those 21.
    options = {"kv_cache_bytes": None, "max_model_len": 100, "kv_compression": compression}
    batched = make_engine(tiny, dynamic_batching=True, max_batch_size=3, **options)
    alone = make_engine(tiny, dynamic_batching=False, max_batch_size=3, **options)
    held = [e.blocks.num_cold_blocks if compression else e.blocks.num_blocks for e in (batched, alone)]
    assert held == [21, 7]
    async with batched as engine:
        engine.submit([1] * 84, SamplingParams(max_new_tokens=16))  # exactly 100: accepted
        with pytest.raises(EngineError, match="MAX_MODEL_LEN"):
            engine.submit([1] * 85, SamplingParams(max_new_tokens=16))


async def test_batch_stops_each_sequence_where_generate_alone_stops(tiny: LoadedModel) -> None:
    engine = make_engine(
        tiny, dynamic_batching=True, max_batch_size=8, dynamic_batch_window_ms=50, max_tokens_per_step=16
    )
    async with engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        results = await asyncio.gather(*(engine.generate(i, SamplingParams(max_new_tokens=40)) for i in ids))
    for prompt_ids, result in zip(ids, results, strict=True):
        assert result.token_ids == generate_alone(tiny, prompt_ids, 40)
    assert max(r.batch_size for r in results) > 1


async def test_without_dynamic_batching_requests_run_one_at_a_time(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, dynamic_batching=False, max_batch_size=8)
    async with engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
        results = await asyncio.gather(*(engine.generate(i, SamplingParams(max_new_tokens=4)) for i in ids))
        assert engine.stats().largest_batch == 1
    assert all(r.batch_size == 1 for r in results)


async def test_generate_passes_each_piece_on_as_it_comes_and_they_make_the_result(tiny: LoadedModel) -> None:
    async with make_engine(tiny) as engine:
        pieces: list[str] = []
        ids = engine.format_chat([{"role": "user", "content": PROMPTS[0]}])
        result = await engine.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True), pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == result.text


async def test_stream_yields_the_result_text(tiny: LoadedModel) -> None:
    async with make_engine(tiny) as engine:
        handle = engine.submit(engine.format_chat([{"role": "user", "content": "会议"}]), SamplingParams(12))
        streamed = "".join([delta async for delta in handle.stream()])
        result = await handle.result()
    assert streamed == result.text


async def test_seeded_sampling_is_reproducible(tiny: LoadedModel) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    async with make_engine(tiny) as engine:
        ids = engine.format_chat([{"role": "user", "content": "hello"}])
        first, second = [await engine.generate(ids, params) for _ in range(2)]
    assert first.token_ids == second.token_ids


async def test_cancelled_request_finishes_as_cancelled(tiny: LoadedModel) -> None:
    async with make_engine(tiny) as engine:
        ids = engine.format_chat([{"role": "user", "content": "hello"}])
        handle = engine.submit(ids, SamplingParams(max_new_tokens=2000, ignore_eos=True))
        await asyncio.sleep(0.05)
        handle.cancel()
        result = await asyncio.wait_for(handle.result(), 10)
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) < 2000


async def test_prompt_longer_than_the_context_is_refused(tiny: LoadedModel) -> None:
    async with make_engine(tiny) as engine:
        with pytest.raises(EngineError, match="context"):
            engine.submit([1] * 2040, SamplingParams(max_new_tokens=64))
    async with make_engine(tiny, kv_cache_bytes=4 * 16 * 512) as engine:
        with pytest.raises(EngineError, match="KV pool"):
            engine.submit([1] * 60, SamplingParams(max_new_tokens=64))


async def test_json_schema_constrains_the_output_of_a_random_model(tiny: LoadedModel) -> None:
    schema = {
        "type": "object",
        "properties": {
            "polarity": {"enum": ["positive", "neutral", "negative"]},
            "escalate": {"type": "boolean"},
        },
        "required": ["polarity", "escalate"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_new_tokens=64, json_schema=json.dumps(schema))
    async with make_engine(
        tiny, dynamic_batching=True, max_batch_size=4, dynamic_batch_window_ms=20
    ) as engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
        free = engine.generate(ids[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
        results = await asyncio.gather(free, *(engine.generate(i, params) for i in ids[1:]))
    for result in results[1:]:
        value = json.loads(result.text)
        assert value["polarity"] in schema["properties"]["polarity"]["enum"]  # type: ignore[index]
        assert isinstance(value["escalate"], bool)
        assert result.finish_reason == "stop"
    assert results[0].token_ids == reference(tiny, ids[0], 8)  # unconstrained row unaffected


async def test_a_new_schema_compiles_once_off_the_engine_thread_while_others_decode(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xgrammar

    compiles: list[tuple[str, int, int]] = []  # (thread, engine steps when it began, when it ended)
    real = xgrammar.GrammarCompiler.compile_json_schema

    def slow(self: object, schema: str, **options: object) -> object:
        began = engine.stats().num_steps
        time.sleep(0.3)
        compiled = real(self, schema, **options)  # type: ignore[arg-type]
        compiles.append((threading.current_thread().name, began, engine.stats().num_steps))
        return compiled

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_json_schema", slow)
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    params = SamplingParams(max_new_tokens=16, json_schema=schema)
    engine = make_engine(tiny, dynamic_batching=True, max_batch_size=4, dynamic_batch_window_ms=0)
    async with engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
        free = asyncio.create_task(
            engine.generate(ids[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        constrained = await asyncio.gather(*(engine.generate(i, params) for i in ids[1:]))
        await engine.prepare(schema)  # compiled already: returns at once
        await free
    assert len(compiles) == 1  # two requests and a prepare, one compilation
    thread, began, ended = compiles[0]
    assert not thread.startswith("engine") and ended > began  # the running request kept stepping
    assert all(json.loads(r.text)["ok"] in (True, False) for r in constrained)


def test_start_up_self_test_passes(test_device: torch.device) -> None:
    from engine.selftest import self_test

    self_test(test_device)


async def test_stop_string_ends_the_request_and_is_cut(tiny: LoadedModel) -> None:
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    async with make_engine(tiny) as engine:
        ids = engine.format_chat([{"role": "user", "content": "hello"}])
        free = await engine.generate(ids, params)
        text = free.text
        # A stop string taken from the middle of the unconstrained output (whole characters only).
        clean = [i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2]]
        assert clean, f"no whole-character pair in {text!r}"
        stop = text[clean[len(clean) // 2] : clean[len(clean) // 2] + 2]
        cut = await engine.generate(ids, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert len(cut.token_ids) < len(free.token_ids)


async def test_teacher_forcing_emits_the_forced_tokens_and_shows_the_models_logits(tiny: LoadedModel) -> None:
    async with make_engine(tiny, dynamic_batching=True, max_batch_size=4) as engine:
        ids = engine.format_chat([{"role": "user", "content": PROMPTS[2]}])
        greedy = reference(tiny, ids, 6)
        forced = [5, 6, 7, 8, 9, 10]
        seen: list[torch.Tensor] = []
        params = SamplingParams(max_new_tokens=6, forced_ids=tuple(forced), ignore_eos=True)
        result = await engine.submit(ids, params, lambda logits: seen.append(logits.clone())).result()
    assert result.token_ids == forced
    assert len(seen) == 6 and seen[0].dtype == torch.float32
    assert int(seen[0].argmax()) == greedy[0]  # the first position sees only the prompt
    with stock_attention(tiny), torch.inference_mode():  # position i sees the prompt + forced[:i]
        full = (
            tiny.model(torch.tensor([ids + forced[:5]], device=tiny.device)).logits[0, len(ids) - 1 :].float()
        )
    assert torch.allclose(torch.stack(seen), full[:, : seen[0].shape[0]], atol=1e-4)
    with pytest.raises(ValueError, match="forced_ids"):
        SamplingParams(max_new_tokens=8, forced_ids=(1, 2))


def direct_logprob(tiny: LoadedModel, prompt: list[int], continuation: list[int]) -> float:
    """Sum of log p(continuation[i] | prompt + continuation[:i]) from one plain forward pass."""
    ids = torch.tensor([prompt + continuation], device=tiny.device)
    with stock_attention(tiny), torch.inference_mode():
        logits = tiny.model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation))


async def test_label_scores_equal_a_direct_forward_pass(tiny: LoadedModel) -> None:
    # Options told apart by their first token are scored by it; one sharing its first tokens with
    # another is teacher-forced up to the token that differs; all match a plain forward pass.
    engine = make_engine(tiny, dynamic_batching=True, max_batch_size=4)
    options = ["positive", "negative", "neutral", "pos", "我们", "我们的"]
    encode = tiny.tokenizer.encode
    encoded = [encode(o, add_special_tokens=False) for o in options]
    lengths = []
    for ids in encoded:
        others = [o for o in encoded if o is not ids]
        lengths.append(
            next((k for k in range(1, len(ids)) if not any(o[:k] == ids[:k] for o in others)), len(ids))
        )
    assert max(lengths) > 1  # the teacher-forced path is taken too
    async with engine:
        for text in PROMPTS[:3]:
            prompt = encode(text)
            scores = await engine.score(prompt, options)
            for ids, n, score in zip(encoded, lengths, scores, strict=True):
                assert score == pytest.approx(direct_logprob(tiny, prompt, ids[:n]), abs=1e-4)


async def test_hidden_states_equal_a_direct_forward_pass_while_others_batch(tiny: LoadedModel) -> None:
    # The state a probe reads: the prompt's last token after `depth` layers, as a plain forward
    # pass computes it, for prompts read in chunks, beside other requests, at every depth.
    layers = int(tiny.model.config.num_hidden_layers)
    async with make_engine(tiny, dynamic_batching=True, max_batch_size=4, max_tokens_per_step=16) as engine:
        prompts = [engine.format_chat([{"role": "user", "content": text}]) for text in PROMPTS[:3]]
        others = [engine.submit(ids, SamplingParams(max_new_tokens=8)) for ids in prompts]
        seen = await asyncio.gather(*(engine.hidden(ids, d) for ids in prompts for d in range(1, layers + 1)))
        await asyncio.gather(*(o.result() for o in others))
        with pytest.raises(EngineError, match="decoder layers"):
            await engine.hidden(prompts[0], layers + 1)
    with stock_attention(tiny), torch.inference_mode():
        direct = [
            tiny.model(torch.tensor([ids], device=tiny.device), output_hidden_states=True).hidden_states
            for ids in prompts
        ]
    expected = [direct[p][d][0, -1].float().cpu() for p in range(len(prompts)) for d in range(1, layers + 1)]
    norm = tiny.model.get_decoder().norm
    with torch.inference_mode():  # HF lists the last layer's output after the final norm
        got = [norm(s.to(tiny.device)).cpu() if i % layers == layers - 1 else s for i, s in enumerate(seen)]
    assert all(g.shape == (int(tiny.model.config.hidden_size),) for g in got)
    assert all(torch.allclose(g, e, atol=1e-4) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("packed", [False, True])
async def test_scored_tokens_read_the_heads_product_in_fp32_not_rounded_to_bf16(
    packed: bool, test_device: torch.device
) -> None:
    # In bf16 the head's output is rounded (to 1/8 near 20), so two label words' scores tie exactly
    # on many documents; the tokens a request names in exact_ids are recomputed from the head's
    # input in fp32: equal to the weight rows times the final hidden state, the rest of the row
    # unchanged, and rounded back, the bf16 logits (a plain head, and the packed head as the
    # loader packs it on a CPU).
    loaded = build_tiny("qwen2", dtype=torch.bfloat16, device=test_device)
    model = loaded.model
    weight = model.lm_head.weight.detach().clone()
    if packed and pack_linears(model, test_device, torch.bfloat16) == 0:
        pytest.skip(f"nothing is packed on {test_device}")
    config = EngineConfig(model_path=Path("unused"), dtype="bfloat16", kv_cache_bytes=1 << 24)
    words = ["positive", "negative", "yes", "no"]
    asked = tuple(dict.fromkeys(loaded.tokenizer.encode(w, add_special_tokens=False)[0] for w in words))
    layers = int(model.config.num_hidden_layers)
    async with Engine(config, loaded) as engine:
        for text in PROMPTS[:3]:
            prompt = engine.format_chat([{"role": "user", "content": text}])
            (rounded,) = await engine.observe(prompt, SamplingParams(max_new_tokens=1))
            (exact,) = await engine.observe(prompt, SamplingParams(max_new_tokens=1, exact_ids=asked))
            hidden = await engine.hidden(prompt, layers)
            with torch.inference_mode():
                final = model.get_decoder().norm(hidden.to(device=test_device, dtype=torch.bfloat16))
                expected = (weight[list(asked)].float() @ final.float()).cpu()
            index = torch.tensor(asked)
            assert torch.allclose(exact[index], expected, atol=1e-4)
            others = torch.ones_like(rounded, dtype=torch.bool)
            others[index] = False
            assert torch.equal(exact[others], rounded[others])
            assert torch.equal(exact[index].bfloat16().float(), rounded[index])
            assert (exact[index] - rounded[index]).abs().max() > 1e-4  # the rounding is really gone
            scores = await engine.score(prompt, words)
            logprobs = torch.log_softmax(exact, dim=-1)
            encoded = [loaded.tokenizer.encode(w, add_special_tokens=False) for w in words]
            singles = [i for i, ids in enumerate(encoded) if distinguishing_length(ids, encoded) == 1]
            assert singles  # options scored by their first token alone
            firsts = [ids[0] for ids in encoded]
            assert all(scores[i] == pytest.approx(float(logprobs[firsts[i]]), abs=1e-5) for i in singles)


async def test_scoring_an_empty_option_is_refused(tiny: LoadedModel) -> None:
    async with make_engine(tiny) as engine:
        with pytest.raises(EngineError, match="empty"):
            await engine.score(tiny.tokenizer.encode("hello"), ["yes", ""])


async def test_stopping_leaves_no_error_behind_for_requests_their_callers_gave_up(tiny: LoadedModel) -> None:
    """A worker that shuts down with work in flight: callers have cancelled, the engine stops.
    What nobody waits for any more must not be reported as an unretrieved error (one log line
    per request, at shutdown); a request still awaited gets the error."""
    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(str(context.get("message"))))
    try:
        engine = make_engine(tiny)
        await engine.start()
        ids = engine.format_chat([{"role": "user", "content": "hello"}])
        gone = engine.submit(ids, SamplingParams(max_new_tokens=50))
        awaited = engine.submit(ids, SamplingParams(max_new_tokens=50))
        gone.cancel()  # its caller was cancelled before the engine looked again
        await engine.stop()
        with pytest.raises(EngineError, match="engine stopped"):
            await awaited.result()
        del gone
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []


async def test_drafted_decodes_change_no_token_and_save_steps(tiny: LoadedModel) -> None:
    """Speculative decoding by prompt lookup: prompts that repeat themselves get drafts, the model
    agrees with many of them (a tiny random model repeats itself too), and every output equals
    recomputation, with drafts crossing block boundaries and a length limit inside a draft; the
    same requests without drafts take more steps; every block comes back."""
    prompts = [" ".join(["one two three four five"] * 6), "a b a b a b a b c a b c", *PROMPTS[:2]]
    params = SamplingParams(max_new_tokens=23, ignore_eos=True)
    stats = {}
    for k in (0, 4):
        engine = make_engine(
            tiny, dynamic_batching=True, max_batch_size=4, dynamic_batch_window_ms=20, block_size=8,
            speculative_tokens=k,
        )  # fmt: skip
        async with engine:
            ids = [engine.format_chat([{"role": "user", "content": p}]) for p in prompts]
            results = await asyncio.gather(*(engine.generate(i, params) for i in ids))
            stats[k] = engine.stats()
        for prompt_ids, result in zip(ids, results, strict=True):
            assert result.token_ids == reference(tiny, prompt_ids, 23)
            assert result.finish_reason == "length"
        assert stats[k].kv_used_bytes == 0, "every block returned, the drafts' too"
    assert stats[0].num_draft_tokens == 0
    assert stats[4].num_accepted_drafts > 10, "the repeating prompts' drafts should often be right"
    assert stats[4].num_accepted_drafts <= stats[4].num_draft_tokens
    assert stats[4].num_steps < stats[0].num_steps


async def test_drafts_under_a_json_schema_or_a_stop_string_change_no_token(tiny: LoadedModel) -> None:
    """Drafts are masked by the grammar as the tokens before them would leave it (a draft the
    grammar refuses ends the verification), and a stop string found inside accepted drafts
    ends the output where it would have: the same results with and without drafts."""
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"polarity": {"enum": ["positive", "negative"]}, "items": {"type": "array"}},
            "required": ["polarity", "items"],
        }
    )
    example = '{"polarity":"negative","items":["late","late","late"]}'
    probe = make_engine(tiny)
    ids = probe.format_chat([{"role": "user", "content": " ".join([example] * 4)}])
    stop = probe.decode(reference(tiny, ids, 14)[9:11])  # a piece the free output reaches
    requests = [
        SamplingParams(max_new_tokens=48, json_schema=schema),
        SamplingParams(max_new_tokens=30, stop=(stop,)),
    ]
    outcomes = {}
    for k in (0, 4):
        engine = make_engine(tiny, dynamic_batching=True, max_batch_size=2, speculative_tokens=k)
        async with engine:
            results = await asyncio.gather(*(engine.generate(ids, p) for p in requests))
            outcomes[k] = [(r.token_ids, r.text, r.finish_reason) for r in results]
            if k:
                assert engine.stats().num_accepted_drafts > 0
    assert outcomes[0] == outcomes[4]
    json.loads(outcomes[4][0][1])
    assert outcomes[4][1][2] == "stop" and stop not in outcomes[4][1][1]
