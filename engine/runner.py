"""Runs one batch of requests to completion on the model: padded prefill, then lock-step decode.

Owns every tensor of a step. Runs on the engine's worker thread; reports tokens through a
callback and never touches asyncio objects itself. Knows nothing of queues or admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from engine.grammar import BatchConstraint, GrammarCompiler
from engine.loader import LoadedModel
from engine.request import EngineError, FinishReason, Request

# (request, token id) for each generated token; (request, reason) when a sequence ends.
TokenSink = Callable[[Request, int, float], None]
FinishSink = Callable[[Request, FinishReason, float], None]


class ModelRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.pad_id = int(loaded.tokenizer.pad_token_id)
        self.eos_ids = _eos_ids(loaded)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 32768))
        self.tokenizer = loaded.tokenizer
        self._grammar: GrammarCompiler | None = None

    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:  # built on first use: indexing a 150k vocabulary takes a moment
            self._grammar = GrammarCompiler(self.tokenizer, int(self.model.config.vocab_size))
        return self._grammar

    def check_fits(self, request: Request) -> None:
        needed = request.num_prompt_tokens + request.params.max_new_tokens
        if needed > self.max_context:
            raise EngineError(
                f"prompt of {request.num_prompt_tokens} tokens + {request.params.max_new_tokens} new tokens "
                f"exceeds the model's context of {self.max_context}"
            )

    @torch.inference_mode()
    def run(self, batch: Sequence[Request], on_token: TokenSink, on_finish: FinishSink) -> None:
        """Generates every request in `batch` until each stops; left padding aligns the prompts."""
        size = len(batch)
        longest = max(r.num_prompt_tokens for r in batch)
        input_ids = torch.full((size, longest), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((size, longest), dtype=torch.long)  # (B, T)
        for row, request in enumerate(batch):
            n = request.num_prompt_tokens
            input_ids[row, longest - n :] = torch.tensor(request.prompt_ids)
            mask[row, longest - n :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        generators = [_generator(r, self.device) for r in batch]
        cache = DynamicCache(config=self.model.config)
        live = [not r.cancelled for r in batch]
        counts = [0] * size
        for request in batch:
            if request.cancelled:
                on_finish(request, "cancelled", time.perf_counter())

        schemas = [r.params.json_schema for r in batch]
        constraint = BatchConstraint(self.grammar(), schemas, self.device) if any(schemas) else None
        logits = self._forward(input_ids, mask, positions, cache)  # (B, V)
        while any(live):
            if constraint is not None:
                constraint.apply(logits, live)
            next_ids = self._sample(logits, batch, generators)  # (B,)
            now = time.perf_counter()
            for row, request in enumerate(batch):
                if not live[row]:
                    continue
                if request.cancelled:
                    live[row] = False
                    on_finish(request, "cancelled", now)
                    continue
                token = int(next_ids[row])
                counts[row] += 1
                if token in self.eos_ids and not request.params.ignore_eos:
                    live[row] = False
                    on_finish(request, "stop", now)
                    continue
                on_token(request, token, now)
                if constraint is not None:
                    constraint.accept(row, token)
                if counts[row] >= request.params.max_new_tokens:
                    live[row] = False
                    on_finish(request, "length", now)
            if not any(live):
                break
            mask = torch.cat([mask, torch.ones((size, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(next_ids[:, None], mask, positions, cache)

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()  # (B, V), sampling always in fp32
        return logits

    @staticmethod
    def _sample(
        logits: torch.Tensor, batch: Sequence[Request], generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)  # (B,)
        if all(r.params.temperature == 0 for r in batch):
            return greedy
        out = greedy.clone()
        for row, request in enumerate(batch):
            params = request.params
            if params.temperature == 0:
                continue
            probs = torch.softmax(logits[row] / params.temperature, dim=-1)  # (V,)
            if params.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                # Keep the smallest prefix whose mass reaches top_p (always at least one token).
                drop = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
                sorted_probs[drop] = 0
                probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            out[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
        return out


def _generator(request: Request, device: torch.device) -> torch.Generator | None:
    if request.params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if request.params.seed is not None:
        generator.manual_seed(request.params.seed)
    else:
        generator.seed()
    return generator


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    config = getattr(loaded.model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return frozenset(ids)
