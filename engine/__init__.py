"""A batching LLM engine over any local Hugging Face causal LM.

Knows token ids, tensors, requests and results. Imports nothing of Kafka, of the pipeline or of
the event schemas: callers pass prompts in and read results out. The names below are what callers
use; each is imported on first use, so that reading the configuration (`engine.config`) does not
load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, EngineOptions, SamplingParams
    from engine.engine import Engine, EngineStats
    from engine.loader import LoadedModel, ModelLoadError, load_model, select_device
    from engine.request import EngineError, GenerationResult, RequestHandle
    from engine.selftest import self_test

_HOMES = {
    "EngineConfig": "engine.config",
    "EngineOptions": "engine.config",
    "SamplingParams": "engine.config",
    "Engine": "engine.engine",
    "EngineStats": "engine.engine",
    "LoadedModel": "engine.loader",
    "ModelLoadError": "engine.loader",
    "load_model": "engine.loader",
    "select_device": "engine.loader",
    "EngineError": "engine.request",
    "GenerationResult": "engine.request",
    "RequestHandle": "engine.request",
    "self_test": "engine.selftest",
}

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOptions",
    "EngineStats",
    "GenerationResult",
    "LoadedModel",
    "ModelLoadError",
    "RequestHandle",
    "SamplingParams",
    "load_model",
    "select_device",
    "self_test",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
