"""Loads a local Hugging Face causal LM folder onto the chosen device and dtype.

Owns device/dtype selection and the clear errors a user sees for a missing or wrong model path.
Knows nothing of where the folder came from (see `pipeline.bundled_models` for the default model).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine import fused, kv_native
from engine.config import Device, DType
from engine.linear import pack_linears

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Architectures whose attention path the engine has been checked against (tests + self-test).
SUPPORTED_MODEL_TYPES: tuple[Literal["qwen2", "llama"], ...] = ("qwen2", "llama")
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class ModelLoadError(RuntimeError):
    """The model folder is missing, incomplete or not a causal language model."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # transformers.PreTrainedModel (untyped library)
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    model_id: str
    device: torch.device
    dtype: torch.dtype


def select_device(device: Device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("DEVICE=cuda was requested but no CUDA device is available")
    return torch.device(device)


def check_model_folder(path: Path) -> dict[str, Any]:
    """The folder's config.json, after checking the folder looks like a causal LM checkpoint."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a folder (a Hugging Face model folder is expected)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model folder: config.json is missing")
    try:
        config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON: {exc}") from exc
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise ModelLoadError(
            f"{path} is not a causal language model (architectures: {architectures or 'none'})"
        )
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path} is a {config.get('model_type')!r} model; "
            f"the engine supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any(next(path.glob(p), None) for p in _WEIGHT_PATTERNS):
        raise ModelLoadError(f"{path} has no weights (*.safetensors or *.bin)")
    return config


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    return frozenset(f for line in text.splitlines() if line.startswith("flags") for f in line.split()[2:])


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matrix products, about 6x slower than fp32 on an AVX2 EPYC (measured 2026-12-01)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def select_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def load_model(
    path: Path,
    device: Device = "auto",
    dtype: DType = "auto",
    prepack_weights: bool = True,
    fuse_layers: bool = True,
) -> LoadedModel:
    """`prepack_weights`: the decoder layers' linear weights and the output head reordered once for
    oneDNN on a CPU, in fp32 or, where the CPU computes it natively, bf16 (`engine.linear`); no
    effect elsewhere. `fuse_layers`: RMSNorm, SiLU * up and the rotary embedding by the native
    kernels on a CPU, q/k/v by one product (`engine.fused`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_folder(path)
    target = select_device(device)
    torch_dtype = select_dtype(dtype, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {exc}") from exc
    model.to(target)
    model.eval()
    if fuse_layers and target.type == "cpu" and torch_dtype in kv_native.DTYPES:
        fused.fuse_layers(model, kv_native.load(), target)  # first: it concatenates plain q/k/v weights
    if prepack_weights:
        pack_linears(model, target, torch_dtype, weights_folder=path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_id = str(getattr(model.config, "_name_or_path", "") or path.name)
    log.info("loaded model %s on %s in %s", path.name, target, str(torch_dtype).removeprefix("torch."))
    return LoadedModel(model, tokenizer, model_id=Path(model_id).name, device=target, dtype=torch_dtype)
