"""A tiny causal LM with a tiny byte-level tokenizer, built in code (tests and the self-test).

Random weights, real architectures (Qwen2 or Llama), a real chat template: everything the
engine touches, at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from engine.loader import LoadedModel

Architecture = Literal["qwen2", "llama"]

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The customer complains that the delivery was late and the fee was wrong.",
    "会议决定下季度增加预算，客户投诉处理时间缩短到两天。",
    '{"core_viewpoint": "x", "key_information": {"facts": [], "data": [], "conclusions": []}}',
    "Revenue grew 12% year over year; the board expects margins to recover.",
]


def build_tokenizer(vocab_size: int = 384) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast: Any = PreTrainedTokenizerFast
    return fast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",  # noqa: S106 - a token, not a password
        pad_token="<|endoftext|>",  # noqa: S106
        chat_template=_CHAT_TEMPLATE,
    )


def build_model(tokenizer: Any, architecture: Architecture = "qwen2", seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    model: Any
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def build_tiny(
    architecture: Architecture = "qwen2",
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> LoadedModel:
    """A tiny model with its tokenizer; the weights are the same on every device (built on the CPU)."""
    device = device or torch.device("cpu")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, architecture).to(device=device, dtype=dtype)
    return LoadedModel(model, tokenizer, model_id=f"tiny-{architecture}", device=device, dtype=dtype)
