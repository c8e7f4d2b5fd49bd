"""Production-shaped models with random weights, for throughput and memory on a GPU host.

Llama-3-8B's or Qwen2.5-7B's shape (layers, widths, heads, KV heads, vocabulary) with weights drawn
at random on the target device: nothing to download, and the speed and KV bytes are the real
model's. What it writes is noise, so only speed and memory mean anything; every quality number
comes from real weights (`bench.kv_quality`, `bench.validity`). The tokenizer is a real one (a
local model folder's), so prompts have their real lengths; the vocabulary is at least the
tokenizer's.

    python -m bench.engine_bench --random-shape llama3-8b --tokenizer DIR --no-isolate ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.loader import LoadedModel

# config.json fields of the published models (vocabulary raised to the tokenizer's where larger).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
}  # fmt: skip


def build_random(
    shape: str,
    tokenizer_dir: Path,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
    seed: int = 0,
) -> LoadedModel:
    """A model of `shape` (optionally cut to `layers` layers, for a smoke test on a small machine)
    with random weights made on `device`, and the tokenizer of `tokenizer_dir`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    fields["vocab_size"] = max(fields["vocab_size"], len(tokenizer))
    if layers is not None:
        fields["num_hidden_layers"] = layers
    ids = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    config = (LlamaConfig if model_type == "llama" else Qwen2Config)(**fields, **ids)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights are made in `dtype`: no fp32 copy of 8B parameters
    try:
        with device:
            model = (LlamaForCausalLM if model_type == "llama" else Qwen2ForCausalLM)(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    name = shape if layers is None else f"{shape}-{layers}-layers"
    return LoadedModel(model.eval(), tokenizer, model_id=f"random-{name}", device=device, dtype=dtype)
