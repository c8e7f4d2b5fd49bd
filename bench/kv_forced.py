"""Next-token agreement along forced tokens: one engine's distributions against a reference's.

Every prompt is submitted with its tokens forced one by one (all together, so every profile sees
the same batching); the reference engine's pass records the top-k distribution at each position
(`reference_pass`), any other engine's gives KL and top-1 agreement against it
(`teacher_forced_pass`). `bench.kv_quality` measures its profiles this way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.kv_formats import continuations
from engine import Engine, SamplingParams
from engine.loader import LoadedModel


@dataclass
class Reference:
    """The uncompressed run's next-token distributions, top-k per output position."""

    ids: list[torch.Tensor]  # per document (n, k) int
    logp: list[torch.Tensor]  # per document (n, k) float


# Per document, a prompt and the tokens forced after it, as token ids.
Forcing = list[tuple[list[int], list[int]]]


def continuation_forcing(loaded: LoadedModel, docs: list[dict[str, Any]], limit: int) -> Forcing:
    """What `bench.kv_formats` forces: each document's narrative prompt naming its label's polarity,
    then the model's unconstrained greedy continuation (transformers' `generate`): the format
    search's KL measured through the engine, on the same tokens."""
    seqs = continuations(loaded.model, loaded.tokenizer, docs, limit)
    return [(ids[:n].tolist(), ids[n:].tolist()) for ids, n in seqs]


async def reference_pass(engine: Engine, forcing: Forcing, top_k: int) -> Reference:
    """The top-k next-token distributions along the forced tokens, recorded in the pass every
    profile's KL is taken in (`teacher_forced_pass`)."""
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in forcing]

    def record(i: int, logits: torch.Tensor) -> None:
        logp, top = torch.log_softmax(logits, dim=-1).topk(top_k)
        rows[i].append((top.to(torch.int32), logp))

    await _forced(engine, forcing, record)
    empty = (torch.zeros(0, top_k, dtype=torch.int32), torch.zeros(0, top_k))
    stacked = [
        (torch.stack([r[0] for r in doc]), torch.stack([r[1] for r in doc])) if doc else empty for doc in rows
    ]
    return Reference([ids for ids, _ in stacked], [logp for _, logp in stacked])


async def teacher_forced_pass(
    engine: Engine, forcing: Forcing, ref: Reference
) -> list[tuple[list[float], list[bool]]]:
    """KL and top-1 agreement against `ref` along the forced tokens."""
    kls: list[list[float]] = [[] for _ in forcing]
    top1: list[list[bool]] = [[] for _ in forcing]

    def compare(i: int, logits: torch.Tensor) -> None:
        pos = len(kls[i])
        kl, same = next_token_agreement(logits, ref.ids[i][pos].long(), ref.logp[i][pos])
        kls[i].append(kl)
        top1[i].append(same)

    await _forced(engine, forcing, compare)
    return list(zip(kls, top1, strict=True))


def next_token_agreement(
    logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor
) -> tuple[float, bool]:
    """KL(reference || these logits) over the reference's top-k tokens plus one bucket for the
    rest of the vocabulary, and whether the token greedy decoding would pick from these logits is
    one the reference would pick too (bf16 logits tie: any of the reference's tied best counts)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = top_logp.float().exp()
    q_logp = logq[top_ids]
    p_rest = max(0.0, 1.0 - float(p.sum()))
    q_rest = max(1e-12, 1.0 - float(q_logp.exp().sum()))
    rest = p_rest * (math.log(p_rest) - math.log(q_rest)) if p_rest > 0 else 0.0
    kl = float((p * (top_logp.float() - q_logp)).sum()) + rest
    return kl, bool((top_ids[top_logp == top_logp[0]] == logits.argmax()).any())


async def _forced(engine: Engine, forcing: Forcing, observe: Callable[[int, torch.Tensor], None]) -> None:
    """Every prompt, then its tokens forced one by one, all submitted together; `observe(document
    index, logits)` at every forced position."""

    async def one(i: int) -> None:
        prompt, forced = forcing[i]
        if not forced:
            return
        params = SamplingParams(max_new_tokens=len(forced), forced_ids=tuple(forced), ignore_eos=True)
        await engine.submit(prompt, params, lambda logits: observe(i, logits)).result()

    await asyncio.gather(*(one(i) for i in range(len(forcing))))
