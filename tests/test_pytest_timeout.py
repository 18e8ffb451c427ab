"""A hanging test fails by its timeout (pyproject's [tool.pytest.ini_options], pytest-timeout), in minutes.

The suite's tests are mostly trio tests, and a hung trio test waits inside the event loop: the timeout must
end it there. A pytest run in a subprocess, under this repository's configuration, runs one test that
sleeps forever with the timeout cut to 2 s, and must fail with pytest-timeout's message well before the
subprocess's own limit. With the "signal" method (SIGALRM) that run hangs until that limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
RUN_LIMIT_S = 240  # the subprocess's own limit: generous, a loaded machine starts pytest slowly

HANGING_TRIO_TEST = textwrap.dedent(
    """
    import pytest
    import trio


    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["trio"])
    async def test_sleeps_forever():
        await trio.sleep_forever()
    """
)


def test_the_suite_has_a_per_test_timeout(pytestconfig: pytest.Config) -> None:
    timeout = float(pytestconfig.getini("timeout"))
    assert 60 <= timeout <= 600, f"timeout = {timeout}: a hang should fail in minutes, a slow test not at all"
    assert pytestconfig.getini("timeout_method") == "thread"


def test_a_hanging_trio_test_fails_by_its_timeout(tmp_path: Path) -> None:
    test_file = tmp_path / "test_hangs.py"
    test_file.write_text(HANGING_TRIO_TEST)
    # -c: this repository's configuration (timeout_method, filterwarnings, markers); -o timeout=2 cuts only
    # the timeout.
    command = [sys.executable, "-m", "pytest", "-c", str(REPOSITORY / "pyproject.toml"), "--rootdir", str(tmp_path),
               "-p", "no:cacheprovider", "-o", "timeout=2", "-v", str(test_file)]
    try:
        finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_LIMIT_S,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the hanging test was not stopped by its 2 s timeout (the run was killed after {RUN_LIMIT_S} s):\n"
                    f"{exc.stdout!r}\n{exc.stderr!r}")
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0, output
    # -v names the test as it starts; then pytest-timeout's banner and every thread's stack, and the process ends.
    assert "test_hangs.py::test_sleeps_forever[trio]" in output, output
    assert re.search(r"\+{10,} Timeout \+{10,}", output), output
