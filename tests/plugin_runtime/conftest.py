"""`cli`: run the asyncengine command as a user would. The plugin distributions (`plugin_target`,
`plugin_env`) are shared fixtures in tests/conftest.py."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture
def cli():
    """Run `asyncengine ARGS...` as a user would, in `env`."""

    def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True, text=True,
                              env=env, timeout=timeout)

    return run
