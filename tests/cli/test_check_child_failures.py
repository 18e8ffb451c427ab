"""`asyncengine plugins check` when a child process fails its start-up: the report is printed, with the
failure in the process where it began and in each parent's phase, and the command exits 1 naming it.
(A failure in the frontend's own phases: tests/plugin_runtime/test_failure_modes.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

PLUGIN = textwrap.dedent(
    """
    import os
    from asyncengine.plugins_api import current_process_role

    def register():
        role = current_process_role()
        if role.startswith(os.environ["AE_TEST_FAIL_IN"]):
            raise RuntimeError(f"ae_fail_in fails in the {role} on purpose")
    """
)


@pytest.fixture
def failing_env(tmp_path):
    """A general plugin (a bare .dist-info, nothing to build) that raises in the role AE_TEST_FAIL_IN names."""
    (tmp_path / "ae_fail_in.py").write_text(PLUGIN)
    dist_info = tmp_path / "ae_fail_in-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: ae-fail-in\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[asyncengine.general_plugins]\nae_fail_in = ae_fail_in:register\n")

    def env(fail_in: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
        env.update(PYTHONPATH=str(tmp_path), AE_TEST_FAIL_IN=fail_in)
        return env

    return env


@pytest.mark.parametrize(("fail_in", "args", "where"), [
    ("worker", ["--distributed-executor-backend", "mp"], r"the worker rank 0 \(pid \d+\)"),
    ("engine core", [], r"the engine core \(pid \d+\)"),
], ids=["worker process", "engine-core process"])
def test_a_child_that_fails_its_check_is_reported_and_exits_1(failing_env, fail_in, args, where):
    result = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "check", *args], capture_output=True,
                            text=True, env=failing_env(fail_in), timeout=180)
    assert result.returncode == 1, result.stderr
    failure = (rf"{where} failed in start-up phase 'general plugins': plugin 'ae_fail_in' \(asyncengine.general_plugins "
               rf"from ae-fail-in 0.1\) raised when called: RuntimeError: ae_fail_in fails in the {fail_in}")
    assert re.search(rf"^asyncengine: check failed: {failure}", result.stderr, re.MULTILINE), result.stderr
    assert "ExceptionGroup" not in result.stderr
    # The report: the frontend's `engine core` phase failed, naming the child where it began.
    assert re.search(rf"^ +\d+\.\d ms  failed  engine core \({failure}", result.stdout, re.MULTILINE), result.stdout
    if fail_in == "worker":  # and the engine core's `start workers`, with the worker's own records
        assert re.search(rf"^ +\d+\.\d ms  failed  start workers \({failure}", result.stdout, re.MULTILINE)
        assert re.search(r"^worker rank 0 \(pid \d+\)$", result.stdout, re.MULTILINE), result.stdout
