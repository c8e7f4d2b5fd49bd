"""Schema-constrained decoding with xgrammar: compiled grammars, per-sequence matchers, bitmasks.

The caller passes a JSON Schema as text (the engine imports no event schema). Compiled grammars
are cached per schema text; each sequence gets its own matcher, so constrained and free
sequences share a batch. Compiling a schema takes seconds: `compile` may run on any thread
(callers of the same schema wait for the one compilation), so the engine can prepare a grammar
without stalling the batch that is decoding.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch

from engine.request import EngineError


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - installed by `make`
        raise EngineError("schema-constrained decoding needs xgrammar (pip install xgrammar==0.2.9)") from exc
    return xgrammar


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()  # guards the map only, never held while compiling

    def is_compiled(self, json_schema: str) -> bool:
        with self._lock:
            done = self._compiled.get(json_schema)
        return done is not None and done.done() and done.exception() is None

    def compile(self, json_schema: str) -> Any:
        """The compiled grammar, compiled here if no other thread has started it."""
        with self._lock:
            future = self._compiled.get(json_schema)
            mine = future is None
            if future is None:
                future = self._compiled[json_schema] = Future()
        if not mine:
            return future.result()
        try:
            # Compact JSON: no free whitespace, so no tokens are spent on indentation.
            future.set_result(self._compiler.compile_json_schema(json_schema, any_whitespace=False))
        except BaseException as exc:  # noqa: BLE001 (whoever waits on it must hear of any failure)
            with self._lock:
                del self._compiled[json_schema]  # a later request may try again
            future.set_exception(exc)
        return future.result()

    def matcher(self, json_schema: str) -> Any:
        return self._xgr.GrammarMatcher(self.compile(json_schema))


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """(rows, ceil(V/32)) int32, every token allowed."""
    return torch.as_tensor(_xgrammar().allocate_token_bitmask(rows, vocab_size))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets, in place, the logits of forbidden tokens to -inf in the given rows."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)
