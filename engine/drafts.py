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

from engine.sequence import Sequence


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
