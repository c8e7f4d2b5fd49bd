"""What the benchmark programs share: the command line's model option and its resolution."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.app import resolve_model_path
from pipeline.settings import load_settings


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with `--model` (default: MODEL_PATH, else the bundled default model)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a local Hugging Face model folder")
    return p


def model_path(arg: Path | None) -> Path:
    return arg if arg is not None else resolve_model_path(load_settings())
