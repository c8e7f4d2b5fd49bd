"""What the benchmark programs share: the command line's model option and its resolution, and the
machine a result was measured on.

The pipeline is imported only where needed, so the engine benchmark runs on a host that has the
engine's packages alone (a GPU host: `bench/cuda_check.sh`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.loader import cpu_flags

if TYPE_CHECKING:
    from engine import Engine
    from engine.config import KVKernel
    from engine.kv_native import NativeKernel
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


def given(**options: Any) -> dict[str, Any]:
    """The options that were set (not None): engine settings a flag left unset keep their default."""
    return {name: value for name, value in options.items() if value is not None}


def model_path(arg: Path | None) -> Path:
    from pipeline.app import resolve_model_path
    from pipeline.settings import load_settings

    return arg if arg is not None else resolve_model_path(load_settings())


async def analysis_engine(arg: Path | None, **settings: Any) -> Engine:
    """The engine the analysis benchmarks (quality, injection, probe) run `model_path(arg)` on:
    dynamic batching, 16 at once, a 1 GiB pool, then `settings` (engine options, e.g. a KV
    compression profile, which may replace those), the rest the defaults."""
    import asyncio

    from engine import Engine, EngineConfig

    config = EngineConfig(
        **{
            "model_path": model_path(arg),
            "dynamic_batching": True,
            "max_batch_size": 16,
            "kv_cache_bytes": 1 << 30,
            **settings,
        }
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


def rotated_rounds(
    runs: dict[str, Callable[[], object]], rounds: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds a run takes (the mean of `repeats` back to back), in each of `rounds` rounds, the
    runs in an order rotated from round to round so that none is always first."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            for _ in range(repeats):
                runs[name]()
            times[name].append((time.perf_counter() - start) / repeats)
    return times


def against(times: dict[str, list[float]], name: str, baseline: str) -> dict[str, Any]:
    """A run's times against a baseline's within each round (baseline time over its time): every
    round, their medians, the ratio's median."""
    ratios = [base / t for t, base in zip(times[name], times[baseline], strict=True)]
    return {"s_median": statistics.median(times[name]), "speed_vs_baseline": ratios,
            "speed_vs_baseline_median": statistics.median(ratios)}  # fmt: skip


def write_result(out: Path, args: argparse.Namespace, console: Any, **fields: Any) -> None:
    """A benchmark's JSON: the machine, its arguments, then `fields`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()}
    out.write_text(json.dumps({"machine": machine(), "config": config, **fields}, indent=1))
    console.print(f"wrote {out}")


def kernel_at(revision: str) -> NativeKernel | None:
    """The native kernel built for this CPU from the engine's C files as they were at a git
    revision of this checkout (to compare a change with what came before it in one run)."""
    from engine import kv_native

    root = Path(kv_native.__file__).parent
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "engine/"], cwd=root.parent, check=True,  # noqa: S607
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kernel-at-") as folder:
        for name in (n for n in listed if n.endswith((".c", ".h"))):
            shown = subprocess.run(
                ["git", "show", f"{revision}:{name}"],  # noqa: S607 - git from PATH
                cwd=root.parent, check=True, capture_output=True,
            )  # fmt: skip
            (Path(folder) / Path(name).name).write_bytes(shown.stdout)
        return kv_native.load("native", Path(folder))  # mapped: the folder may go


def kernel_builds() -> dict[str, NativeKernel]:
    """KV_KERNEL choice -> the native kernels built for it, for every path this CPU can run: the
    portable loops, AVX2's, and its own (`auto`), in that order."""
    from engine import kv_native
    from engine.kv_policy import kernel_target

    found: dict[str, NativeKernel] = {}
    choices: tuple[KVKernel, ...] = ("portable", "avx2", "auto")
    for choice in choices:
        try:
            target = kernel_target(choice)
        except ValueError:  # this CPU lacks the path
            continue
        kernel = kv_native.load(target)
        if kernel is not None:
            found[choice] = kernel
    return found
