"""The engine's public face: async `submit` of token ids, per-request stream and result, stats.

Admission: with dynamic batching, the oldest waiting request waits at most `batch_window_ms` for
others to join, and a batch is filled with the requests whose prompt lengths are closest to it
(up to `max_batch_size`); without it, requests run one at a time in arrival order. The model runs
on one worker thread so the event loop (Kafka, HTTP) never blocks on a forward pass.

Knows nothing of Kafka, events or prompts: callers bring token ids (or chat messages to format).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, SamplingParams
from engine.loader import LoadedModel, load_model
from engine.request import EngineError, FinishReason, GenerationResult, Request, RequestHandle, id_counter
from engine.runner import FinishSink, ModelRunner, TokenSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    model_id: str
    device: str
    dtype: str
    dynamic_batching: bool
    kv_compression: bool
    max_batch_size: int
    num_waiting: int
    num_running: int
    num_batches: int
    num_finished: int
    num_generated_tokens: int
    mean_batch_size: float
    largest_batch: int

    @property
    def batch_occupancy(self) -> float:
        """Mean batch size as a share of the largest allowed."""
        return self.mean_batch_size / self.max_batch_size if self.max_batch_size else 0.0


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(loaded)
        self._next_id = id_counter()
        self._waiting: list[Request] = []
        self._arrived = asyncio.Event()
        self._running: list[Request] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._num_batches = 0
        self._num_finished = 0
        self._num_tokens = 0
        self._batched_requests = 0
        self._largest_batch = 0
        if config.kv_compression:
            log.warning(
                "KV_COMPRESSION=true is accepted and reported, but KV compression is not implemented yet"
            )

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        return cls(config, load_model(config.model_path, config.device, config.dtype))

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    async def start(self) -> None:
        if self._loop_task is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._loop_task = asyncio.create_task(self._serve(), name="engine-loop")

    async def stop(self) -> None:
        for request in [*self._waiting, *self._running]:
            request.cancelled = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for request in self._waiting:
            request.fail(EngineError("engine stopped"))
        self._waiting.clear()
        if self._executor is not None:
            # The worker finishes its current step, sees the cancelled flags and returns.
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None
        for request in self._running:
            request.fail(EngineError("engine stopped"))
        self._running.clear()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def format_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> RequestHandle:
        if self._loop_task is None:
            raise EngineError("engine is not started")
        if not prompt_ids:
            raise EngineError("empty prompt")
        request = Request(
            self._next_id(), list(prompt_ids), params or SamplingParams(), asyncio.get_running_loop()
        )
        self.runner.check_fits(request)
        self._waiting.append(request)
        self._arrived.set()
        return RequestHandle(request, self.decode)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationResult:
        handle = self.submit(prompt_ids, params)
        try:
            return await handle.result()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    def stats(self) -> EngineStats:
        return EngineStats(
            model_id=self.model_id,
            device=str(self.loaded.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            dynamic_batching=self.config.dynamic_batching,
            kv_compression=self.config.kv_compression,
            max_batch_size=self.config.max_batch_size,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_batches=self._num_batches,
            num_finished=self._num_finished,
            num_generated_tokens=self._num_tokens,
            mean_batch_size=self._batched_requests / self._num_batches if self._num_batches else 0.0,
            largest_batch=self._largest_batch,
        )

    # -- scheduling ---------------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            now = time.perf_counter()
            for request in batch:
                request.scheduled_at = now
                request.batch_size = len(batch)
            self._running = batch
            self._num_batches += 1
            self._batched_requests += len(batch)
            self._largest_batch = max(self._largest_batch, len(batch))
            try:
                await loop.run_in_executor(
                    self._executor, self.runner.run, batch, self._token_sink(loop), self._finish_sink(loop)
                )
            except Exception as exc:  # a failed forward fails its batch, not the engine
                log.exception("batch of %d failed", len(batch))
                for request in batch:
                    request.fail(EngineError(f"generation failed: {exc}"))
            finally:
                self._running = []

    async def _next_batch(self) -> list[Request]:
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        limit = self.config.effective_batch_size
        if limit > 1:
            deadline = self._waiting[0].arrived_at + self.config.batch_window_ms / 1000
            while len(self._waiting) < limit and (remaining := deadline - time.perf_counter()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
        self._waiting = [r for r in self._waiting if not self._drop_if_cancelled(r)]
        if not self._waiting:
            return []
        batch = select_batch(self._waiting, limit)
        chosen = {id(r) for r in batch}
        self._waiting = [r for r in self._waiting if id(r) not in chosen]
        return batch

    def _drop_if_cancelled(self, request: Request) -> bool:
        if request.cancelled:
            request.finish("cancelled", "", time.perf_counter())
        return request.cancelled

    def _token_sink(self, loop: asyncio.AbstractEventLoop) -> TokenSink:
        def sink(request: Request, token: int, now: float) -> None:
            loop.call_soon_threadsafe(request.push, token, now)

        return sink

    def _finish_sink(self, loop: asyncio.AbstractEventLoop) -> FinishSink:
        def sink(request: Request, reason: FinishReason, now: float) -> None:
            loop.call_soon_threadsafe(self._finish, request, reason, now)

        return sink

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        self._num_finished += 1
        self._num_tokens += len(request.output_ids)
        request.finish(reason, self.decode(request.output_ids), now)


def select_batch(waiting: Sequence[Request], limit: int) -> list[Request]:
    """The oldest request plus the waiting ones whose prompt lengths are closest to it."""
    anchor = waiting[0]
    others = sorted(
        waiting[1:], key=lambda r: (abs(r.num_prompt_tokens - anchor.num_prompt_tokens), r.arrived_at)
    )
    return [anchor, *others[: limit - 1]]
