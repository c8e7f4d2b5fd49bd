"""A batching LLM engine over any local Hugging Face causal LM.

Knows token ids, tensors, requests and results. Imports nothing of Kafka, of the pipeline or of
the event schemas: callers pass prompts in and read results out.
"""

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine, EngineStats
from engine.loader import LoadedModel, ModelLoadError, load_model
from engine.request import EngineError, GenerationResult, RequestHandle

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "GenerationResult",
    "LoadedModel",
    "ModelLoadError",
    "RequestHandle",
    "SamplingParams",
    "load_model",
]
