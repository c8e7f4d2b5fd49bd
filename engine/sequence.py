"""A request's state inside the engine: its tokens, how many are in the KV cache, its status."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from engine.request import Request

if TYPE_CHECKING:
    import torch

    from engine.drafts import NgramIndex


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose keys/values are in the cache
    status: Status = Status.WAITING
    num_preemptions: int = 0
    num_settled_blocks: int = 0  # leading blocks already considered for quantised storage
    num_dropped: int = 0  # tokens pruned from the cache: position p sits at cache index p - this
    pruned: bool = False  # the pruning decision for this residency in the cache has been made
    deferred_at: int = -1  # the scheduler plan in which its prompt chunk last gave way to a newcomer
    matcher: Any = None  # xgrammar GrammarMatcher, created on the runner thread on first use
    generator: torch.Generator | None = field(default=None, repr=False)
    prefix_keys: list[bytes] = field(default_factory=list, repr=False)  # its block keys, memoised
    final_text: str | None = None  # set when a stop string ended the sequence: the text before it
    ngrams: NgramIndex | None = field(default=None, repr=False)  # its text's n-grams, for drafts

    @classmethod
    def of(cls, seq_id: int, request: Request) -> Sequence:
        return cls(seq_id, request, list(request.prompt_ids), request.num_prompt_tokens)

    @property
    def num_pending(self) -> int:
        """Tokens to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_cached(self) -> int:
        """Tokens whose keys and values the cache holds (computed, less those pruned)."""
        return self.num_computed - self.num_dropped

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_output > 0
