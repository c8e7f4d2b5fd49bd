"""Schema-constrained decoding with xgrammar: per-sequence matchers, one token bitmask per step.

The caller passes a JSON Schema as text (the engine imports no event schema). Compiled grammars
are cached per schema text; each request gets its own matcher, so constrained and free requests
share a batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

    def matcher(self, json_schema: str) -> Any:
        with self._lock:
            compiled = self._compiled.get(json_schema)
            if compiled is None:
                # Compact JSON: no free whitespace, so no tokens are spent on indentation.
                compiled = self._compiler.compile_json_schema(json_schema, any_whitespace=False)
                self._compiled[json_schema] = compiled
        return self._xgr.GrammarMatcher(compiled)


class BatchConstraint:
    """The matchers of one batch (None: unconstrained row) and their shared bitmask."""

    def __init__(
        self, compiler: GrammarCompiler, schemas: Sequence[str | None], device: torch.device
    ) -> None:
        self._xgr = _xgrammar()
        self.matchers = [compiler.matcher(s) if s is not None else None for s in schemas]
        self.rows = [i for i, m in enumerate(self.matchers) if m is not None]
        self.bitmask = self._xgr.allocate_token_bitmask(len(schemas), compiler.vocab_size)  # (B, ceil(V/32))
        self.device = device

    def apply(self, logits: torch.Tensor, live: Sequence[bool]) -> None:
        """Masks, in place, every token the grammar forbids for each live constrained row."""
        rows = [i for i in self.rows if live[i]]
        if not rows:
            return
        for i in rows:
            matcher = self.matchers[i]
            if matcher is not None:
                matcher.fill_next_token_bitmask(self.bitmask, i)
        mask = self.bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)

    def accept(self, row: int, token: int) -> bool:
        """Advances the row's matcher; True once its grammar is complete."""
        matcher = self.matchers[row]
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            raise EngineError(f"token {token} rejected by the grammar")
        return bool(matcher.is_terminated())
