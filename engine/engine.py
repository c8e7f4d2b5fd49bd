"""The engine's public face: async `submit` of token ids, per-request stream and result, stats.

Continuous batching: every step, running sequences decode one token each, prompts are read in
chunks within a token budget, and waiting requests join as soon as there is room. When the engine
is idle, the first arrival waits up to `batch_window_ms` for others so a batch forms (the article's
window); once anything runs, newcomers join at the next step. `dynamic_batching=False` runs the
same engine one request at a time. The model runs on one worker thread, so the event loop (Kafka,
HTTP) never blocks on a forward pass; all scheduling state lives on the loop.

Knows nothing of Kafka, events or prompts: callers bring token ids (or chat messages to format).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.attention import register
from engine.block_manager import BlockManager
from engine.config import EngineConfig, SamplingParams
from engine.kv_cache import KVCache, KVShape
from engine.loader import LoadedModel, load_model
from engine.request import EngineError, FinishReason, GenerationResult, Request, RequestHandle, id_counter
from engine.runner import ModelRunner
from engine.scheduler import Chunk, Scheduler, SchedulerConfig
from engine.sequence import Sequence, Status

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
    num_steps: int
    num_finished: int
    num_generated_tokens: int
    num_preemptions: int
    mean_batch_size: float  # sequences per step
    largest_batch: int
    kv_total_bytes: int
    kv_used_bytes: int
    kv_bytes_per_token: int
    prefix_caching: bool
    prefix_cached_blocks: int  # blocks holding a registered prefix, in use or evictable
    prefix_hit_tokens: int  # prompt tokens adopted from the cache instead of computed, since start

    @property
    def batch_occupancy(self) -> float:
        """Mean sequences per step as a share of the most allowed."""
        return self.mean_batch_size / self.max_batch_size if self.max_batch_size else 0.0


def pool_blocks(config: EngineConfig, shape: KVShape, device: torch.device) -> int:
    """Blocks that fit the KV byte budget: KV_CACHE_BYTES, else a share of free memory."""
    budget = config.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        budget = int(free * config.kv_cache_memory_fraction)
    return max(1, budget // (shape.bytes_per_token * config.block_size))


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        loaded.model.set_attn_implementation(register())
        shape = KVShape.of(loaded.model.config, loaded.dtype)
        num_blocks = pool_blocks(config, shape, loaded.device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        self.cache = KVCache(shape, num_blocks, config.block_size, loaded.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=config.effective_batch_size,
                max_tokens_per_step=max(config.max_tokens_per_step, config.effective_batch_size),
            ),
            self.blocks,
        )
        self.runner = ModelRunner(loaded, self.cache, self.blocks)
        self.max_context = int(getattr(loaded.model.config, "max_position_embeddings", 32768))
        self.eos_ids = _eos_ids(loaded)
        self._next_id = id_counter()
        self._sequences: dict[int, Sequence] = {}
        self._arrived = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._num_steps = 0
        self._num_scheduled = 0
        self._largest = 0
        self._num_finished = 0
        self._num_tokens = 0
        log.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB (%d bytes/token)",
            num_blocks, config.block_size, self.cache.total_bytes / 2**20, shape.bytes_per_token,
        )  # fmt: skip
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

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
            self._loop_task = asyncio.create_task(self._serve(), name="engine-loop")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None
        for seq in list(self._sequences.values()):
            self._finish(seq, None, EngineError("engine stopped"))

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- requests -----------------------------------------------------------------------------

    def format_chat(self, messages: Seq[dict[str, str]]) -> list[int]:
        """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, token_ids: Seq[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def submit(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> RequestHandle:
        if self._loop_task is None:
            raise EngineError("engine is not started")
        if not prompt_ids:
            raise EngineError("empty prompt")
        params = params or SamplingParams()
        needed = len(prompt_ids) + params.max_new_tokens
        if needed > self.max_context:
            raise EngineError(
                f"prompt of {len(prompt_ids)} tokens + {params.max_new_tokens} new tokens "
                f"exceeds the model's context of {self.max_context}"
            )
        if self.blocks.blocks_for(needed) > self.blocks.num_blocks:
            raise EngineError(f"{needed} tokens cannot fit the KV pool ({self.blocks.num_blocks} blocks)")
        request = Request(self._next_id(), list(prompt_ids), params, asyncio.get_running_loop())
        seq = Sequence.of(request.request_id, request)
        self._sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        self._arrived.set()
        return RequestHandle(request, self.decode)

    async def generate(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> GenerationResult:
        handle = self.submit(prompt_ids, params)
        try:
            return await handle.result()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    def stats(self) -> EngineStats:
        bytes_per_block = self.cache.bytes_per_block
        return EngineStats(
            model_id=self.model_id,
            device=str(self.loaded.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            dynamic_batching=self.config.dynamic_batching,
            kv_compression=self.config.kv_compression,
            max_batch_size=self.config.max_batch_size,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_steps=self._num_steps,
            num_finished=self._num_finished,
            num_generated_tokens=self._num_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            mean_batch_size=self._num_scheduled / self._num_steps if self._num_steps else 0.0,
            largest_batch=self._largest,
            kv_total_bytes=self.blocks.num_blocks * bytes_per_block,
            kv_used_bytes=self.blocks.num_used * bytes_per_block,
            kv_bytes_per_token=self.cache.shape.bytes_per_token,
            prefix_caching=self.config.prefix_caching,
            prefix_cached_blocks=self.blocks.num_cached,
            prefix_hit_tokens=self.blocks.num_cache_hits * self.blocks.block_size,
        )

    # -- the step loop ------------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self.scheduler.has_work:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            wait = self._admission_wait()
            if wait > 0 and not self.scheduler.running:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), wait)
                continue
            plan = self.scheduler.schedule(admit=wait <= 0)
            if not plan:
                await asyncio.sleep(0)
                continue
            started = time.perf_counter()
            for chunk in plan:
                if chunk.seq.request.scheduled_at is None:
                    chunk.seq.request.scheduled_at = started
                chunk.seq.request.batch_size = max(chunk.seq.request.batch_size, len(plan))
            try:
                tokens = await loop.run_in_executor(self._executor, self.runner.step, plan)
            except Exception as exc:  # a failed step fails its sequences, not the engine
                log.exception("step of %d sequences failed", len(plan))
                for chunk in plan:
                    self._finish(chunk.seq, None, EngineError(f"generation failed: {exc}"))
                continue
            self._num_steps += 1
            self._num_scheduled += len(plan)
            self._largest = max(self._largest, len(plan))
            self._postprocess(plan, tokens, time.perf_counter())

    def _admission_wait(self) -> float:
        """Seconds to hold admission so a batch can form; <= 0 admits now."""
        waiting = self.scheduler.waiting
        if not waiting or not self.config.dynamic_batching or self.scheduler.running:
            return 0.0
        if len(waiting) >= self.config.max_batch_size:
            return 0.0
        oldest = min(s.request.arrived_at for s in waiting)
        return oldest + self.config.batch_window_ms / 1000 - time.perf_counter()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._sequences.values() if s.request.cancelled]:
            self._finish(seq, "cancelled")

    def _postprocess(self, plan: Seq[Chunk], tokens: Seq[int | None], now: float) -> None:
        for chunk, token in zip(plan, tokens, strict=True):
            seq = chunk.seq
            if seq.status is Status.FINISHED:
                continue
            self.scheduler.computed(chunk)
            if token is None:
                continue
            params = seq.request.params
            if token in self.eos_ids and not params.ignore_eos:
                self._finish(seq, "stop")
                continue
            seq.token_ids.append(token)
            seq.request.push(token, now)
            if params.stop and self._hit_stop(seq):
                self._finish(seq, "stop")
            elif seq.num_output >= params.max_new_tokens or len(seq.token_ids) >= self.max_context:
                self._finish(seq, "length")
            elif seq.matcher is not None and seq.matcher.is_terminated():
                self._finish(seq, "stop")

    def _hit_stop(self, seq: Sequence) -> bool:
        """Whether the output now contains a stop string; if so, remembers the text before it.

        Only the tail that can hold a new match is decoded each step (a stop string is at most a
        few tokens long), so the check stays cheap as outputs grow."""
        stops = seq.request.params.stop
        tail = self.decode(seq.output_ids[-(max(map(len, stops)) + 8) :])
        if not any(s in tail for s in stops):
            return False
        text = self.decode(seq.output_ids)
        seq.final_text = text[: min(i for s in stops if (i := text.find(s)) >= 0)]
        return True

    def _finish(self, seq: Sequence, reason: FinishReason | None, error: EngineError | None = None) -> None:
        self.scheduler.finish(seq)
        self._sequences.pop(seq.seq_id, None)
        if error is not None:
            seq.request.fail(error)
            return
        self._num_finished += 1
        self._num_tokens += seq.num_output
        text = seq.final_text if seq.final_text is not None else self.decode(seq.output_ids)
        seq.request.finish(reason or "stop", text, time.perf_counter())


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    config = getattr(loaded.model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return frozenset(ids)
