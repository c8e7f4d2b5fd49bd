"""Prompt-lookup drafts: what follows the latest earlier occurrence of the longest matching tail."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from engine import drafts
from engine.config import SamplingParams
from engine.drafts import CPU_STEP_TOKENS, NgramIndex, PromptLookup, step_tokens
from engine.request import Request
from engine.sequence import Sequence


def lookup_by_hand(tokens: list[int], max_n: int, k: int) -> list[int]:
    """The definition, searched directly: the longest tail (at most `max_n` tokens) that occurred
    earlier, its latest earlier occurrence, and up to `k` tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_a_repeated_phrase_is_continued_from_its_latest_occurrence() -> None:
    index = NgramIndex(max_n=3)
    assert index.propose([7, 1, 2, 3, 9, 9, 1, 2, 3, 5, 6, 1, 2, 3], k=4) == [5, 6, 1, 2]
    assert NgramIndex(max_n=3).propose([1, 2, 3, 4], k=4) == [], "no tail occurred before"
    assert NgramIndex(max_n=3).propose([1, 2, 1], k=4) == [2, 1], "never past the end"
    assert NgramIndex(max_n=3).propose([5, 5, 5], k=0) == []


def test_incremental_index_proposes_what_the_definition_does() -> None:
    """Grown a few tokens at a time, as a sequence decodes, the index proposes exactly what a
    search of the whole list proposes, on random lists of a small vocabulary (many repeats)."""
    rng = random.Random(0)
    for trial in range(200):
        max_n, k = rng.randint(1, 4), rng.randint(1, 6)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        index = NgramIndex(max_n)
        for _ in range(30):
            assert index.propose(tokens, k) == lookup_by_hand(tokens, max_n, k), (trial, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_only_greedy_requests_guess_and_never_past_their_last_new_token() -> None:
    """Sampled, teacher-forced and observed requests never guess (each of their tokens must come
    from a step of its own); a greedy one guesses at most what the step's room and its remaining
    new tokens allow."""
    loop = asyncio.new_event_loop()
    try:
        prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # its tail occurred before: 4, 5, 6, 1, ... follow

        def seq(params: SamplingParams, **observers: Any) -> Sequence:
            return Sequence.of(0, Request(0, prompt, params, loop, **observers))

        lookup = PromptLookup(tokens=4)
        assert lookup(seq(SamplingParams(max_new_tokens=10)), room=100) == (4, 5, 6, 1)
        assert lookup(seq(SamplingParams(max_new_tokens=10)), room=2) == (4, 5)
        assert lookup(seq(SamplingParams(max_new_tokens=3)), room=100) == (4, 5), "2 left after the next"
        assert lookup(seq(SamplingParams(max_new_tokens=1)), room=100) == ()
        assert lookup(seq(SamplingParams(max_new_tokens=10, temperature=0.7)), room=100) == ()
        assert lookup(seq(SamplingParams(max_new_tokens=2, forced_ids=(7, 7))), room=100) == ()
        assert lookup(seq(SamplingParams(max_new_tokens=10), observer=lambda _: None), room=100) == ()
        assert lookup(seq(SamplingParams(max_new_tokens=10), hidden=(1, lambda _: None)), room=100) == ()
    finally:
        loop.close()


def test_unset_step_tokens_bound_guesses_on_a_cpu_without_amx_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECULATIVE_STEP_TOKENS unset: a CPU without AMX bounds a step of decodes at
    `CPU_STEP_TOKENS`; with AMX, and on CUDA, the step's budget alone bounds it (0); a value
    set, 0 included, is taken as it is on every device."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for flags, expected in ((["avx512f", "avx512_bf16"], CPU_STEP_TOKENS), (["avx512_bf16", "amx_bf16"], 0)):
        monkeypatch.setattr(drafts, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert step_tokens(None, cpu) == expected, flags
        assert step_tokens(None, cuda) == 0, "a GPU computes a full batch's guesses cheaply"
        assert (step_tokens(0, cpu), step_tokens(96, cpu), step_tokens(48, cuda)) == (0, 96, 48)
