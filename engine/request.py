"""A request's life in the engine: its state, its token stream and its result."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.config import SamplingParams

FinishReason = Literal["stop", "length", "cancelled", "error"]
LogitsObserver = Callable[[torch.Tensor], None]  # sees each next-token fp32 logits row (V,), in order
# (depth, observer): the observer sees, for each token the request samples, the hidden state (H,)
# of the position it is sampled from after `depth` decoder layers (fp32, on the CPU).
HiddenObserver = tuple[int, Callable[[torch.Tensor], None]]


class EngineError(RuntimeError):
    """A request could not be generated (prompt too long, engine stopped, model failure)."""


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: FinishReason
    queued_s: float  # submit -> first forward that includes it
    ttft_s: float  # submit -> first generated token
    total_s: float  # submit -> finished
    batch_size: int  # sequences in the forward passes that generated it (largest seen)

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Request:
    """Mutable state of one sequence. Written by the runner thread via the loop, read by callers."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    observer: LogitsObserver | None = None  # called on the engine's worker thread
    hidden: HiddenObserver | None = None  # likewise
    arrived_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    batch_size: int = 0
    cancelled: bool = False
    done: asyncio.Future[GenerationResult] = field(init=False)
    tokens: asyncio.Queue[int | None] = field(init=False)  # None ends the stream

    def __post_init__(self) -> None:
        self.done = self.loop.create_future()
        self.tokens = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    # Called on the event loop, by the engine's step loop.
    def push(self, token_id: int, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.append(token_id)
        self.tokens.put_nowait(token_id)

    def finish(self, reason: FinishReason, text: str, now: float) -> None:
        if self.done.done():
            return
        scheduled = self.scheduled_at if self.scheduled_at is not None else now
        first = self.first_token_at if self.first_token_at is not None else now
        self.done.set_result(
            GenerationResult(
                text=text,
                token_ids=list(self.output_ids),
                prompt_tokens=self.num_prompt_tokens,
                finish_reason=reason,
                queued_s=scheduled - self.arrived_at,
                ttft_s=first - self.arrived_at,
                total_s=now - self.arrived_at,
                batch_size=self.batch_size,
            )
        )
        self.tokens.put_nowait(None)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            if self.cancelled:  # its caller has gone: nobody would retrieve the error (asyncio logs it)
                self.done.cancel()
            else:
                self.done.set_exception(exc)
        self.tokens.put_nowait(None)


class RequestHandle:
    """What `Engine.submit` returns: an async text stream, the final result, and cancellation."""

    def __init__(self, request: Request, decode: Callable[[Sequence[int]], str]) -> None:
        self._request = request
        self._decode = decode

    @property
    def request_id(self) -> int:
        return self._request.request_id

    @property
    def done(self) -> bool:
        return self._request.done.done()

    def cancel(self) -> None:
        self._request.cancelled = True

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._request.done)

    async def stream(self) -> AsyncIterator[str]:
        """Text deltas as tokens arrive; never splits a multi-byte character."""
        ids: list[int] = []
        emitted = ""
        while (item := await self._request.tokens.get()) is not None:
            ids.append(item)
            text = self._decode(ids)
            # A trailing U+FFFD means the last token ends inside a character: wait for the rest.
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(emitted):
                yield text[len(emitted) :]
                emitted = text
        text = self._decode(ids)  # the sequence ended: whatever was held back is final
        if len(text) > len(emitted):
            yield text[len(emitted) :]


def id_counter() -> Callable[[], int]:
    counter = itertools.count()
    return lambda: next(counter)
