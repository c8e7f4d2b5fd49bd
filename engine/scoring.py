"""A choice among labels, scored by the model's own distribution.

For each continuation of a prompt: the log-probability of its tokens up to the first one that
tells it apart from every other continuation (all of them, for one that begins another). The
choice the model would make token by token between the options is decided there; what follows
is spelling. One request reads the prompt and yields the first token's distribution, which
scores every continuation told apart by its first token; the others are teacher-forced on in
requests of their own, which find the prompt's blocks in the prefix cache and compute only the
rest. The scored tokens' logits are the head's product in fp32 (`SamplingParams.exact_ids`): in
bf16 a logit near 20 is rounded to 1/8, and the 0.5B model's yes and no came out exactly tied on a
sixth of real documents, so that the label was the rounding's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.request import EngineError

if TYPE_CHECKING:
    from engine.engine import Engine


async def score_continuations(engine: Engine, prompt_ids: Seq[int], continuations: Seq[str]) -> list[float]:
    encoded = [engine.tokenizer.encode(text, add_special_tokens=False) for text in continuations]
    if any(not ids for ids in encoded):
        raise EngineError("cannot score an empty continuation")
    needed = [distinguishing_length(ids, encoded) for ids in encoded]
    firsts_asked = tuple(dict.fromkeys(ids[0] for ids in encoded))
    first = await engine.observe(prompt_ids, SamplingParams(max_new_tokens=1, exact_ids=firsts_asked))
    firsts = torch.log_softmax(first[0], dim=-1)
    scores = [float(firsts[ids[0]]) for ids in encoded]
    longer = [i for i, n in enumerate(needed) if n > 1]
    rests = await asyncio.gather(*(_forced(engine, prompt_ids, encoded[i][: needed[i]]) for i in longer))
    for i, rest in zip(longer, rests, strict=True):
        scores[i] += rest
    return scores


async def _forced(engine: Engine, prompt_ids: Seq[int], ids: list[int]) -> float:
    """Log-probability of ids[1:] after prompt + ids[0] (the first token is scored apart)."""
    forced = SamplingParams(
        max_new_tokens=len(ids) - 1, forced_ids=tuple(ids[1:]), ignore_eos=True, exact_ids=tuple(set(ids[1:]))
    )
    rows = await engine.observe([*prompt_ids, ids[0]], forced)
    return sum(float(torch.log_softmax(row, dim=-1)[token]) for row, token in zip(rows, ids[1:], strict=True))


def distinguishing_length(ids: list[int], everyone: list[list[int]]) -> int:
    """Tokens of `ids` up to the first that no other sequence shares at that place (all of
    them when another sequence begins with `ids`)."""
    others = [o for o in everyone if o is not ids]
    for n in range(1, len(ids) + 1):
        if not any(o[:n] == ids[:n] for o in others):
            return n
    return len(ids)
