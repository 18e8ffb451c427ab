"""The `asyncengine` command as a user runs it: a real subprocess, its output and exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncengine import __version__


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncengine", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"asyncengine {__version__}"


@pytest.mark.slow
def test_generate_answers_paris_with_the_default_model(default_model_dir):
    # The session's converted copy of the default model, so the subprocess need not convert again.
    cache_root = default_model_dir.parent.parent
    result = run_cli(
        "generate", "What is the capital of France? Answer in one word.", "--max-model-len", "1024",
        env={"ASYNCENGINE_CACHE_DIR": str(cache_root)},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_unknown_flag_is_a_usage_error():
    result = run_cli("generate", "hi", "--no-such-flag")
    assert result.returncode == 2 and "--no-such-flag" in result.stderr


def test_bad_option_value_is_a_usage_error_naming_the_option():
    result = run_cli("generate", "hi", "--block-size", "0")
    assert result.returncode == 2 and "block_size" in result.stderr


def test_missing_model_is_a_startup_failure(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nowhere"))
    assert result.returncode == 1
    assert "start-up failed" in result.stderr and "nowhere" in result.stderr
    assert "Traceback" not in result.stderr
