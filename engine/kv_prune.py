"""Which of a sequence's cached tokens to keep when its prompt has been read (KV pruning).

Two scoring policies over the tokens between the sinks and the observation window:
* `attention` (SnapKV): the attention the last `window` prompt tokens (the instruction to
  answer) pay to each earlier token, summed over heads and layers during the final prompt
  chunk, then max-pooled over neighbours so that kept tokens come with their context;
* `heuristic` (the article's rule, as a baseline): punctuation, function words and repeated
  bigrams score 0, every other token 1; ties keep the later tokens.
The first `sinks` and the last `window` tokens are always kept; the top-scoring rest fill the
budget of `keep_ratio` of all tokens. Keys are cached after RoPE, so kept tokens keep their
positions: only the cache indices change.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

FUNCTION_WORDS = frozenset(
    [
        "的",
        "了",
        "是",
        "在",
        "和",
        "与",
        "及",
        "也",
        "就",
        "都",
        "而",
        "或",
        "着",
        "过",
        "吗",
        "呢",
        "吧",
        "啊",
        "之",
        "其",
        "这",
        "那",
        "把",
        "被",
        "对",
        "从",
        "向",
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "at",
        "by",
        "for",
        "and",
        "or",
        "but",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "it",
        "its",
        "this",
        "that",
        "with",
        "as",
    ]
)


def smooth(scores: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """Max-pools scores over a window of neighbours (odd `kernel`), as SnapKV does."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]


def heuristic_scores(token_ids: Sequence[int], text_of: Callable[[int], str]) -> torch.Tensor:
    """1 for a content token, 0 for punctuation, a function word or a repeated bigram."""
    scores = torch.ones(len(token_ids))
    seen: set[tuple[int, int]] = set()
    for i, token in enumerate(token_ids):
        text = text_of(token).strip().lower()
        if not text or all(unicodedata.category(c)[0] in "PSZC" for c in text) or text in FUNCTION_WORDS:
            scores[i] = 0
        if i:
            pair = (token_ids[i - 1], token)
            if pair in seen:
                scores[i] = 0
            seen.add(pair)
    return scores


def select_kept(scores: torch.Tensor, keep_ratio: float, sinks: int, window: int) -> torch.Tensor:
    """Sorted indices of the tokens to keep among `len(scores)`: sinks, window, and the best rest.

    Ties go to later tokens (closer to the question being answered)."""
    total = int(scores.shape[0])
    budget = max(sinks + window, round(keep_ratio * total))
    if budget >= total:
        return torch.arange(total)
    middle = scores[sinks : total - window].float()
    # A tiny ramp makes later tokens win ties without changing any real ordering.
    ramp = torch.linspace(0, 1e-6, middle.shape[0]) * (middle.abs().max() + 1)
    chosen = (middle + ramp).topk(budget - sinks - window).indices + sinks
    head, tail = torch.arange(min(sinks, total)), torch.arange(max(sinks, total - window), total)
    kept, _ = torch.sort(torch.cat((head, chosen, tail)))
    return kept
