"""The engine's public face: async `submit` of token ids, per-request stream and result, stats.

Continuous batching: every step, running sequences decode one token each, prompts are read in
chunks within a token budget, and waiting requests join as soon as there is room. When the engine
is idle, the first arrival waits up to `dynamic_batch_window_ms` for others so a batch forms (the article's
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
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.attention import register
from engine.block_manager import BlockManager
from engine.config import EngineConfig, SamplingParams
from engine.drafts import PromptLookup, step_tokens
from engine.kv_cache import KVShape
from engine.kv_policy import CompressionConfig, Compressor, Moves, build_cache
from engine.loader import LoadedModel, load_model
from engine.request import (
    EngineError,
    FinishReason,
    GenerationResult,
    HiddenObserver,
    LogitsObserver,
    Request,
    RequestHandle,
    id_counter,
)
from engine.runner import ModelRunner, StepOutput
from engine.scheduler import Chunk, Scheduler, SchedulerConfig
from engine.scoring import score_continuations
from engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    model_id: str
    device: str
    dtype: str
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
    kv_bytes_per_token: int  # full precision, all layers
    kv_tokens: int  # tokens of running sequences whose keys and values are held
    kv_quant_bits: int | None  # the fewest bits of any layer (see KV_INT8_LAYERS); None: uncompressed
    kv_cold_bytes_per_token: float  # of a quantised block, all layers; 0 when uncompressed
    kv_reader: str | None  # how quantised blocks are read: "native-<isa>" or "torch"; None: none
    decode_reader: str  # how decodes read full-precision history: "native-<isa>" (in place) or "torch"
    prefix_caching: bool
    prefix_cached_blocks: int  # blocks holding a registered prefix, in use or evictable
    prefix_hit_tokens: int  # prompt tokens adopted from the cache instead of computed, since start
    prompt_reader: str = "torch"  # how prompt chunks read history: "native-<isa>" (in place), "torch"
    num_draft_tokens: int = 0  # draft tokens proposed to decodes (prompt lookup), since start
    num_accepted_drafts: int = 0  # of which the model agreed with: tokens that cost no step of their own

    @property
    def kv_ratio(self) -> float:
        """Live bytes per held token as a share of full precision (1.0 when nothing is held)."""
        if not self.kv_tokens:
            return 1.0
        return self.kv_used_bytes / self.kv_tokens / self.kv_bytes_per_token


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        loaded.model.set_attn_implementation(register())
        shape = KVShape.of(loaded.model.config, loaded.dtype)
        model_context = int(getattr(loaded.model.config, "max_position_embeddings", 32768))
        self.max_context = min(model_context, config.max_model_len)
        self.cache = build_cache(config, shape, loaded.device, self.max_context)
        num_blocks, num_cold = self.cache.num_blocks, self.cache.cold.num_blocks if self.cache.cold else 0
        prefix_caching = config.prefix_caching and not config.pruning
        if config.prefix_caching and config.pruning:
            log.info("KV pruning is on: prefix caching is off (pruned sequences cannot share blocks)")
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching, num_cold)
        compression = CompressionConfig.of(config)
        self.compressor = Compressor(compression, self.blocks, self._text_of)
        pruning = config.pruning  # guesses and KV pruning are not combined (never tested together)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=config.effective_batch_size,
                max_tokens_per_step=max(config.max_tokens_per_step, config.effective_batch_size),
                prune_window=compression.prune_window,
                together_s=config.dynamic_batch_window_ms / 1000 if config.dynamic_batching else 0.0,
                decode_defer_steps=config.decode_defer_steps,
                saturated_tokens_per_step=config.saturated_budget,
                draft_step_tokens=step_tokens(config.speculative_step_tokens, loaded.device),
            ),
            self.blocks,
            PromptLookup(config.speculative_tokens) if config.speculative_tokens and not pruning else None,
        )
        self.runner = ModelRunner(loaded, self.cache, self.blocks, compression.attention_window)
        self._token_text: dict[int, str] = {}
        self.eos_ids = _eos_ids(loaded)
        self._next_id = id_counter()
        self._sequences: dict[int, Sequence] = {}
        self._arrived = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._num_steps = 0
        self._num_drafted = 0  # draft tokens proposed (speculative decoding)
        self._num_accepted = 0  # of which the model agreed with
        self._num_scheduled = 0
        self._largest = 0
        self._num_finished = 0
        self._num_tokens = 0
        log.info(
            "KV pool: %d full-precision + %d int%d blocks x %d tokens%s, %.1f MiB (%d bytes/token full)%s; "
            "decode attention: %s; prompt attention: %s",
            num_blocks, num_cold, config.kv_quant_bits, config.block_size,
            "".join(
                f" ({name} {', '.join(map(str, named))})"
                for name, named in (
                    ("int8 in layers", config.kv_int8_layers),
                    ("int6 in layers", config.kv_int6_layers),
                    ("int6 in parts", config.kv_int6_parts),
                )
                if named
            ),
            self.cache.total_bytes / 2**20,
            shape.bytes_per_token, f", read by {self.cache.cold.reader}" if self.cache.cold else "",
            self.cache.decode_reader, self.cache.prompt_reader,
        )  # fmt: skip
        if self.scheduler.draft is not None:
            step = self.scheduler.config.draft_step_tokens
            log.info(
                "guesses by prompt lookup: up to %d a decode, %s", config.speculative_tokens,
                f"at most {step} tokens a step of decodes" if step else "within the step's budget",
            )  # fmt: skip
        if config.quantising and not num_cold:
            log.warning("KV_COMPRESSION=true but the KV budget leaves no room for quantised blocks")
        if config.kv_compression and getattr(loaded.model.config, "use_sliding_window", False):
            raise EngineError("KV compression does not support sliding-window attention models")

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        return cls(
            config,
            load_model(
                config.model_path, config.device, config.dtype, config.prepack_weights, config.fuse_layers
            ),
        )

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

    def submit(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams | None = None,
        observer: LogitsObserver | None = None,
        hidden: HiddenObserver | None = None,
    ) -> RequestHandle:
        """Queues a request. `observer`, if given, sees the fp32 logits of every token it samples
        (on the worker thread, before sampling): with `forced_ids`, a teacher-forced evaluation.
        `hidden`, if given, likewise sees the hidden state those logits come from at its depth."""
        if self._loop_task is None:
            raise EngineError("engine is not started")
        if not prompt_ids:
            raise EngineError("empty prompt")
        params = params or SamplingParams()
        needed = len(prompt_ids) + params.max_new_tokens
        if needed > self.max_context:
            raise EngineError(
                f"prompt of {len(prompt_ids)} tokens + {params.max_new_tokens} new tokens "
                f"exceeds the longest request accepted, {self.max_context} tokens (MAX_MODEL_LEN, "
                "at most the model's context)"
            )
        capacity = self.blocks.num_blocks + self.blocks.num_cold_blocks
        if self.blocks.blocks_for(needed) > capacity:
            raise EngineError(f"{needed} tokens cannot fit the KV pool ({capacity} blocks)")
        if hidden is not None and not 1 <= hidden[0] <= self.runner.num_layers:
            raise EngineError(f"depth {hidden[0]}: the model has {self.runner.num_layers} decoder layers")
        request = Request(
            self._next_id(), list(prompt_ids), params, asyncio.get_running_loop(), observer, hidden
        )
        seq = Sequence.of(request.request_id, request)
        self._sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        self._arrived.set()
        return RequestHandle(request, self.decode)

    async def prepare(self, json_schema: str) -> None:
        """Compiles the grammar of `json_schema` (once per schema) on a thread of its own, so that
        a request with a new schema does not stall the steps of the sequences already running.
        `generate` calls it; services call it at start for the schemas they will use."""
        if self.runner.grammar_ready(json_schema):
            return
        try:
            await asyncio.to_thread(lambda: self.runner.grammar().compile(json_schema))
        except EngineError:
            raise
        except Exception as exc:  # xgrammar rejects the schema: the request fails, not the engine
            raise EngineError(f"the JSON schema cannot be compiled to a grammar: {exc}") from exc

    async def generate(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """The finished generation; `on_text`, when given, sees each piece of text as it comes."""
        if params is not None and params.json_schema is not None:
            await self.prepare(params.json_schema)
        handle = self.submit(prompt_ids, params)
        try:
            if on_text is not None:
                async for piece in handle.stream():
                    on_text(piece)
            return await handle.result()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def score(self, prompt_ids: Seq[int], continuations: Seq[str]) -> list[float]:
        """Each continuation's log-probability after the prompt, up to the token that tells it
        apart from the others: a choice among labels by the model's own distribution (`scoring`)."""
        return await score_continuations(self, prompt_ids, continuations)

    async def observe(self, prompt_ids: Seq[int], params: SamplingParams) -> list[torch.Tensor]:
        """Runs a request and returns the fp32 logits of every token it sampled, on the CPU."""
        rows: list[torch.Tensor] = []
        await self._finished(
            self.submit(prompt_ids, params, lambda row: rows.append(row.float().cpu().clone()))
        )
        return rows

    async def hidden(self, prompt_ids: Seq[int], depth: int) -> torch.Tensor:
        """The hidden state (H,) of the prompt's last token after `depth` decoder layers (fp32, on
        the CPU): what a probe trained on the model's representations reads."""
        rows: list[torch.Tensor] = []
        await self._finished(
            self.submit(prompt_ids, SamplingParams(max_new_tokens=1), hidden=(depth, rows.append))
        )
        return rows[0]

    @staticmethod
    async def _finished(handle: RequestHandle) -> GenerationResult:
        """The request's result; cancelled with its caller."""
        try:
            return await handle.result()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    def stats(self) -> EngineStats:
        bytes_per_block = self.cache.bytes_per_block
        cold = self.cache.cold
        cold_block = self.cache.bytes_per_cold_block
        return EngineStats(
            model_id=self.model_id,
            device=str(self.loaded.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_steps=self._num_steps,
            num_finished=self._num_finished,
            num_generated_tokens=self._num_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            mean_batch_size=self._num_scheduled / self._num_steps if self._num_steps else 0.0,
            largest_batch=self._largest,
            kv_total_bytes=self.cache.total_bytes,
            kv_used_bytes=self.blocks.num_used * bytes_per_block + self.blocks.num_used_cold * cold_block,
            kv_bytes_per_token=self.cache.shape.bytes_per_token,
            kv_tokens=sum(s.num_computed for s in self.scheduler.running),
            kv_quant_bits=cold.lowest_bits if cold else None,
            kv_cold_bytes_per_token=cold_block / self.cache.block_size,
            kv_reader=cold.reader if cold else None,
            decode_reader=self.cache.decode_reader,
            prompt_reader=self.cache.prompt_reader,
            prefix_caching=self.blocks.prefix_caching,
            prefix_cached_blocks=self.blocks.num_cached,
            prefix_hit_tokens=self.blocks.num_cache_hits * self.blocks.block_size,
            num_draft_tokens=self._num_drafted,
            num_accepted_drafts=self._num_accepted,
        )

    # -- the step loop ------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            plan = await self._next_plan()
            moves = self.compressor.moves(self.scheduler.running)
            output = await self._run(plan, moves)
            if output is not None:
                self._postprocess(plan, output, time.perf_counter())

    async def _next_plan(self) -> list[Chunk]:
        """Waits for work, holds admission while a batch forms, and returns the next step's chunks."""
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
            if plan := self.scheduler.schedule(admit=wait <= 0):
                return plan
            await asyncio.sleep(0)

    async def _run(self, plan: list[Chunk], moves: Moves) -> StepOutput | None:
        """One forward on the worker thread; a failed step fails its sequences, not the engine."""
        started = time.perf_counter()
        for chunk in plan:
            request = chunk.seq.request
            if request.scheduled_at is None:
                request.scheduled_at = started
            request.batch_size = max(request.batch_size, len(plan))
        loop = asyncio.get_running_loop()
        try:
            output = await loop.run_in_executor(self._executor, self.runner.step, plan, moves)
        except Exception as exc:
            log.exception("step of %d sequences failed", len(plan))
            for chunk in plan:
                self._finish(chunk.seq, None, EngineError(f"generation failed: {exc}"))
            return None
        self._num_steps += 1
        self._num_scheduled += len(plan)
        self._largest = max(self._largest, len(plan))
        return output

    def _admission_wait(self) -> float:
        """Seconds to hold admission so a batch can form; <= 0 admits now."""
        waiting = self.scheduler.waiting
        if not waiting or not self.config.dynamic_batching or self.scheduler.running:
            return 0.0
        if len(waiting) >= self.config.max_batch_size:
            return 0.0
        oldest = min(s.request.arrived_at for s in waiting)
        return oldest + self.config.dynamic_batch_window_ms / 1000 - time.perf_counter()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._sequences.values() if s.request.cancelled]:
            self._finish(seq, "cancelled")

    def _postprocess(self, plan: Seq[Chunk], output: StepOutput, now: float) -> None:
        for chunk, tokens in zip(plan, output.tokens, strict=True):
            seq = chunk.seq
            if seq.status is Status.FINISHED:
                continue
            self.scheduler.computed(chunk)
            if not tokens:
                continue
            if self.compressor.wants_pruning(seq):
                self.compressor.prune(seq, output.scores.get(seq.seq_id))
            for i, token in enumerate(tokens):
                if i:  # the token before this one was a draft the model agreed with: it is cached
                    self.scheduler.accepted(seq)
                    self._num_accepted += 1
                if not self._emit(seq, token, now):
                    break
            if chunk.draft:
                self._num_drafted += len(chunk.draft)
                self.scheduler.release_drafts(seq)

    def _emit(self, seq: Sequence, token: int, now: float) -> bool:
        """Appends a generated token, or finishes the sequence; whether it goes on."""
        params = seq.request.params
        if token in self.eos_ids and not params.ignore_eos:
            self._finish(seq, "stop")
            return False
        seq.token_ids.append(token)
        seq.request.push(token, now)
        if params.stop and self._hit_stop(seq):
            self._finish(seq, "stop")
        elif seq.num_output >= params.max_new_tokens or len(seq.token_ids) >= self.max_context:
            self._finish(seq, "length")
        elif seq.matcher is not None and seq.matcher.is_terminated():
            self._finish(seq, "stop")
        return seq.status is not Status.FINISHED

    def _text_of(self, token: int) -> str:
        if token not in self._token_text:
            self._token_text[token] = self.decode([token])
        return self._token_text[token]

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
