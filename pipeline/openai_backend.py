"""An OpenAI-compatible server as the analyser's model (ANALYZER_BACKEND=openai): vLLM, llama.cpp's
llama-server, Ollama, TGI, reached at OPENAI_BASE_URL through the `openai` client.

The same prompts as the embedded engine, as chat messages:

- a generation streams (time to first token measured here), under the answer's JSON Schema as
  `response_format` where the server takes it (OPENAI_JSON_SCHEMA); the analyser validates and
  repairs the answer as it does the engine's;
- a labelling question asks for one token with its `top_logprobs`: each allowed answer's score
  is the probability of the first tokens that spell its beginning (`option_logprobs`). Our labels
  differ in their first character (zh) or word (en), where that first token decides the choice;
  a token that begins two answers is shared between them;
- at most `concurrency` requests are open at once (MAX_INFLIGHT); a request the server refused for
  now (429, 5xx), timed out or lost is retried with backoff (OPENAI_RETRIES, tenacity); the rest
  fail the document as the engine's errors do (a dead letter with the server's message).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from engine import EngineError, EngineOptions, EngineStats, GenerationResult, SamplingParams
from engine.request import FinishReason
from pipeline.analyzer import Messages, OnText
from pipeline.settings import Settings

TOP_LOGPROBS = 20  # the most the OpenAI API returns per token
_RETRIED_STATUS = frozenset({408, 409, 425, 429})


@dataclass(frozen=True)
class ServerResult(GenerationResult):
    """A server's generation: its token count from `usage` (a server sends no token ids)."""

    completion_tokens: int = 0

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens


def transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed as it is, later: lost, timed out, or refused for now."""
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRIED_STATUS or exc.status_code >= 500
    return False


def option_logprobs(top: dict[str, float], options: Sequence[str]) -> list[float]:
    """Each option's log-probability as its first token: the summed probability of the returned
    tokens that begin it (or that it begins, like "yes," for "yes"), a token consistent with
    several options split evenly among them. An option no returned token begins gets the mass the
    list leaves unaccounted, shared among such options, and at most the least likely token's."""
    shares = [0.0] * len(options)
    for token, logprob in top.items():
        text = token.strip()
        if not text:
            continue
        fits = [i for i, option in enumerate(options) if option.startswith(text) or text.startswith(option)]
        for i in fits:
            shares[i] += math.exp(logprob) / len(fits)
    unseen = [i for i, share in enumerate(shares) if share == 0.0]
    if unseen:
        rest = max(1.0 - sum(math.exp(lp) for lp in top.values()), 1e-12) / len(unseen)
        floor = min(top.values(), default=math.log(rest))
        for i in unseen:
            shares[i] = math.exp(min(math.log(rest), floor))
    return [math.log(share) for share in shares]


class OpenAIBackend:
    """The analyser's model on an OpenAI-compatible server (`pipeline.analyzer.AnalysisEngine`)."""

    provider = "openai"  # gen_ai.provider.name: the API spoken

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        model: str | None,
        concurrency: int,
        retries: int,
        json_schema: bool = True,
        backoff_s: float = 0.5,
    ) -> None:
        self.client = client
        self._model = model
        self._slots = asyncio.Semaphore(concurrency)
        self._retries = retries
        self._backoff_s = backoff_s  # the first retry's wait; each next one doubles, up to 30 s
        self._json_schema = json_schema
        # Our engine's switches do not apply to a server: reported off, the batch bound ours.
        self._options = EngineOptions(max_batch_size=min(concurrency, 256))
        self._waiting = self._running = self._sent = self._finished = self._generated = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIBackend:
        """The backend of `pipeline.settings.Settings` (ANALYZER_BACKEND=openai)."""
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key is not None else "none"
        client = openai.AsyncOpenAI(
            base_url=settings.openai_base_url, api_key=key, timeout=settings.openai_timeout_s, max_retries=0
        )
        return cls(
            client,
            model=settings.openai_model,
            concurrency=settings.max_inflight,
            retries=settings.openai_retries,
            json_schema=settings.openai_json_schema,
        )

    async def __aenter__(self) -> OpenAIBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.client.close()

    async def start(self) -> None:
        """Reaches the server (retried like a request) and, unless OPENAI_MODEL names one, takes
        the first model it lists."""
        try:
            models = await self._retrying(self.client.models.list)
        except openai.OpenAIError as exc:
            raise EngineError(f"the model server at {self.client.base_url} did not answer: {exc}") from exc
        names = [m.id for m in models.data]
        if self._model is None:
            if not names:
                raise EngineError(
                    f"the model server at {self.client.base_url} lists no model; set OPENAI_MODEL"
                )
            self._model = names[0]

    @property
    def model_id(self) -> str:
        if self._model is None:
            raise EngineError("the backend is not started")
        return self._model

    @property
    def config(self) -> EngineOptions:
        return self._options

    async def prepare(self, json_schema: str) -> None:
        """Nothing to compile here: the server turns each request's schema into its grammar."""

    async def generate(
        self, messages: Messages, params: SamplingParams | None = None, on_text: OnText | None = None
    ) -> GenerationResult:
        params = params or SamplingParams()
        if params.forced_ids:
            raise EngineError("teacher forcing needs the embedded engine")
        request: dict[str, Any] = {
            "model": self.model_id,
            "messages": list(messages),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": list(params.stop) or None,
        }
        if params.json_schema is not None and self._json_schema:
            schema = json.loads(params.json_schema)
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "analysis", "schema": schema, "strict": True},
            }
        submitted = time.perf_counter()
        result: GenerationResult = await self._call(lambda: self._stream(request, submitted, on_text))
        return result

    async def _stream(
        self, request: dict[str, Any], submitted: float, on_text: OnText | None
    ) -> GenerationResult:
        """One streamed generation; its times counted from `submitted` (a slot's wait is queueing)."""
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        chunks = prompt_tokens = 0
        completion_tokens: int | None = None
        finish: FinishReason = "stop"
        stream = await self.client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            if chunk.usage is not None:
                prompt_tokens, completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first if first is not None else time.perf_counter() - submitted
                    parts.append(choice.delta.content)
                    if on_text is not None:
                        on_text(choice.delta.content)
                    chunks += 1
                if choice.finish_reason is not None:
                    finish = "length" if choice.finish_reason == "length" else "stop"
        total = time.perf_counter() - submitted
        tokens = completion_tokens if completion_tokens is not None else chunks
        self._generated += tokens
        return ServerResult(
            text="".join(parts),
            token_ids=[],
            prompt_tokens=prompt_tokens,
            finish_reason=finish,
            queued_s=started - submitted,
            ttft_s=first if first is not None else total,
            total_s=total,
            batch_size=1,
            completion_tokens=tokens,
        )

    async def hidden(self, messages: Messages, depth: int) -> list[float]:
        raise EngineError("an OpenAI-compatible server does not expose the model's hidden states")

    async def score(self, messages: Messages, continuations: Sequence[str]) -> list[float]:
        if any(not c for c in continuations):
            raise EngineError("cannot score an empty continuation")
        request: dict[str, Any] = {"model": self.model_id, "messages": list(messages)}
        response = await self._call(
            lambda: self.client.chat.completions.create(
                **request, max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=TOP_LOGPROBS
            )
        )
        choice = response.choices[0] if response.choices else None
        content = choice.logprobs.content if choice is not None and choice.logprobs is not None else None
        if not content:
            raise EngineError("the model server returned no logprobs (does it support top_logprobs?)")
        top = {entry.token: entry.logprob for entry in content[0].top_logprobs}
        top.setdefault(content[0].token, content[0].logprob)
        return option_logprobs(top, continuations)

    async def _call(self, send: Any) -> Any:
        """`send()` within the concurrency bound, retried while the failure is transient; the
        server's last answer as an EngineError otherwise."""
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1

        async def counted() -> Any:
            self._sent += 1
            return await send()

        try:
            return await self._retrying(counted)
        except openai.OpenAIError as exc:
            raise EngineError(f"the model server failed the request: {exc}") from exc
        finally:
            self._running -= 1
            self._finished += 1
            self._slots.release()

    async def _retrying(self, send: Any) -> Any:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(transient),
            stop=stop_after_attempt(self._retries + 1),
            wait=wait_exponential_jitter(multiplier=self._backoff_s, max=30, jitter=self._backoff_s),
            reraise=True,
        ):
            with attempt:
                return await send()
        raise AssertionError("unreachable")  # pragma: no cover

    def stats(self) -> EngineStats:
        return EngineStats(
            model_id=self._model or "",
            device=f"server {self.client.base_url}",
            dtype="server",
            num_waiting=self._waiting,
            num_running=self._running,
            num_steps=self._sent,
            num_finished=self._finished,
            num_generated_tokens=self._generated,
            num_preemptions=0,
            mean_batch_size=0.0,
            largest_batch=0,
            kv_total_bytes=0,
            kv_used_bytes=0,
            kv_bytes_per_token=0,
            kv_tokens=0,
            kv_quant_bits=None,
            kv_cold_bytes_per_token=0.0,
            kv_reader=None,
            decode_reader="server",
            prompt_reader="server",
            prefix_caching=False,
            prefix_cached_blocks=0,
            prefix_hit_tokens=0,
        )
