"""What the benchmark programs share: the command line's model option and its resolution, and the
machine a result was measured on.

The pipeline is imported only where needed, so the engine benchmark runs on a host that has the
engine's packages alone (a GPU host: `bench/cuda_check.sh`)."""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.loader import cpu_flags

if TYPE_CHECKING:
    from engine import Engine
    from pipeline.labels import LabelPolicy
    from pipeline.settings import Settings


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with `--model` (default: MODEL_PATH, else the bundled MODEL)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a local Hugging Face model folder")
    return p


def names(parser: argparse.ArgumentParser, text: str, known: Iterable[str]) -> list[str]:
    """The comma-separated names of `text`, each one of `known` (else the parser's error)."""
    chosen, known = [n for n in text.split(",") if n], list(known)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        parser.error(f"unknown names {unknown}; known: {', '.join(known)}")
    return chosen


def model_path(arg: Path | None) -> Path:
    from pipeline.app import resolve_model_path
    from pipeline.settings import load_settings

    return arg if arg is not None else resolve_model_path(load_settings())


async def analysis_engine(arg: Path | None, **settings: Any) -> Engine:
    """The engine the analysis benchmarks (quality, injection, probe) run `model_path(arg)` on:
    dynamic batching, 16 at once, a 1 GiB pool, `settings` (engine options, e.g. a KV compression
    profile), the rest the defaults."""
    import asyncio

    from engine import Engine, EngineConfig

    config = EngineConfig(
        model_path=model_path(arg),
        dynamic_batching=True,
        max_batch_size=16,
        kv_cache_bytes=1 << 30,
        **settings,
    )
    return await asyncio.to_thread(Engine.from_config, config)


def label_policy(arg: Path | None, parts: int | None = None, guard: int | None = None) -> LabelPolicy:
    """The service's label policy for the model `model_path(arg)` resolves (`--model`: the default),
    its probe reading `parts` parts of each document and checking a complaint's positive reading in
    `guard` parts where given (`--parts`, `--guard`; else the service's)."""
    import dataclasses

    from pipeline.labels import LabelPolicy
    from pipeline.service import label_policy
    from pipeline.settings import load_settings

    policy = LabelPolicy() if arg is not None else label_policy(load_settings())
    if parts is not None:
        policy = dataclasses.replace(policy, polarity_parts=parts)
    return policy if guard is None else dataclasses.replace(policy, guard_parts=guard)


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a worker process that loads exactly `settings` (`pipeline.settings.child_env`)
    and imports this checkout, plus `extra`."""
    import os

    from pipeline.settings import child_env

    return child_env(settings, os.environ) | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])} | extra


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def machine() -> dict[str, Any]:
    """The CPU count and the instruction-set features a result depends on."""
    flags = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    return {"cpus": os.cpu_count(), "cpu_flags": [f for f in wanted if f in flags]}
