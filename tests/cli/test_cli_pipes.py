"""A reader that stops early (`asyncengine plugins map | head -1`, here `| true`, which exits before the
command has imported anything, so its first write always meets a closed pipe) is not a failure of the command:
no BrokenPipeError traceback, exit status 0, so `set -o pipefail` scripts (the docs' examples) work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_a_closed_pipe_ends_the_command_quietly():
    asyncengine = Path(sys.executable).parent / "asyncengine"
    script = f"set -o pipefail; '{asyncengine}' plugins map --markdown | true"
    completed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, ASYNCENGINE_PLUGINS=""))
    assert completed.returncode == 0, completed.stderr
    assert "Traceback" not in completed.stderr and "BrokenPipeError" not in completed.stderr
