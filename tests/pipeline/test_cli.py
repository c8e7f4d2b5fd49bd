"""The CLI's errors are sentences, not tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_invalid_setting_names_the_variable() -> None:
    result = run_cli("run", MAX_BATCH_SIZE="-3")
    assert result.returncode == 2
    assert "MAX_BATCH_SIZE" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli("run", MODEL_PATH=str(tmp_path / "missing"), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert result.returncode == 3
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_model_path_that_is_not_a_model(tmp_path: Path) -> None:
    result = run_cli("run", MODEL_PATH=str(tmp_path), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert result.returncode == 3
    assert "config.json is missing" in result.stderr
