"""Draft tokens for speculative decoding by prompt lookup.

A sequence's next tokens are guessed from its own text: the tokens that followed the latest
earlier occurrence of its last `max_n` tokens (or fewer, down to one) in its prompt or output. An
analysis quotes its document, so its drafts are often right. The engine feeds a decode's drafts
after its next token in one step and keeps the longest prefix the model itself would have chosen,
plus the model's own token after it: the greedy output is the same in exact arithmetic (in bf16
a near-tie can flip, as batching order flips it), and a step yields 1 to k + 1 tokens. Which
requests may guess is decided here (`PromptLookup`, the scheduler's drafter); how many tokens a
step can carry, by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.loader import cpu_flags
from engine.sequence import Sequence

# SPECULATIVE_STEP_TOKENS where it is unset, on a CPU without AMX: a full batch of 32 guesses one token each
CPU_STEP_TOKENS = 64


@dataclass(frozen=True)
class PromptLookup:
    """Up to `tokens` guesses for a greedy decode (`max_n`: the longest tail looked up), never past
    its last new token; none for sampled, teacher-forced or observed requests, whose every token
    must come from its own step."""

    tokens: int
    max_n: int = 3

    def __call__(self, seq: Sequence, room: int) -> tuple[int, ...]:
        request, params = seq.request, seq.request.params
        if params.temperature > 0 or params.forced_ids or request.observer or request.hidden:
            return ()
        k = min(self.tokens, room, params.max_new_tokens - seq.num_output - 1)
        if k <= 0:
            return ()
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.max_n)
        return tuple(seq.ngrams.propose(seq.token_ids, k))


def step_tokens(configured: int | None, device: torch.device) -> int:
    """The most tokens a step of decodes alone carries with its guesses (the scheduler's
    `draft_step_tokens`; 0: its budget alone): SPECULATIVE_STEP_TOKENS, or where it is unset, by
    the device. On a CPU without AMX a step's products turn from reading the weights to computing
    at 32-64 rows (AVX-512 BF16, 24 layers' products: 45 ms at 32 rows, 69 at 64, 120 at 128), so
    a full batch's guesses cost about what its tokens cost, and 45 % of guesses are wrong: there a
    step carries `CPU_STEP_TOKENS`. AMX and GPUs compute those rows for little more than the
    weights' reading: there the budget alone bounds them."""
    if configured is not None:
        return configured
    if device.type == "cpu" and "amx_bf16" not in cpu_flags():
        return CPU_STEP_TOKENS
    return 0


@dataclass
class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a growing token list last occurred: the position of
    the token that followed it. Indexed incrementally, so a step costs the new tokens only."""

    max_n: int
    next_of: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `next_of`

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the list's longest
        matching tail (at most `max_n` tokens); none when no tail occurred before."""
        end = len(token_ids)
        for last in range(self.indexed, end - 1):  # n-grams ending at `last`, followed by last + 1
            for n in range(1, min(self.max_n, last + 1) + 1):
                self.next_of[tuple(token_ids[last - n + 1 : last + 1])] = last + 1
        self.indexed = max(self.indexed, end - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, end), 0, -1):
            start = self.next_of.get(tuple(token_ids[end - n :]))
            if start is not None:
                return list(token_ids[start : start + k])
        return []
