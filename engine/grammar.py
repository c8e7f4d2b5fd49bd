"""Schema-constrained decoding with xgrammar: compiled grammars, per-sequence matchers, bitmasks.

The caller passes a JSON Schema as text (the engine imports no event schema). Compiled grammars
are cached per schema text; each sequence gets its own matcher, so constrained and free
sequences share a batch.
"""

from __future__ import annotations

import threading
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


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """(rows, ceil(V/32)) int32, every token allowed."""
    return torch.as_tensor(_xgrammar().allocate_token_bitmask(rows, vocab_size))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets, in place, the logits of forbidden tokens to -inf in the given rows."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)
