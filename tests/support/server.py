"""Run `asyncengine serve` as a real subprocess on a free port, as a user would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# The shared test server (tests/server/conftest.py) serves the default model under this name, with this key.
API_KEY = "test-key-123"
MODEL_NAME = "SmolLM2-135M-Instruct"

_SERVING = re.compile(r"^asyncengine: serving .* on (http://\S+)$", re.MULTILINE)


@dataclass
class RunningServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    stdout_path: Path
    stderr_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server and wait for it to exit; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server did not exit within {timeout} s of {signal.Signals(sig).name}; "
                                 f"stderr:\n{self.stderr()[-3000:]}") from None


def start_server(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180) -> RunningServer:
    """Start `asyncengine serve ARGS --port 0`; returns once it printed the address it listens on."""
    directory = Path(tempfile.mkdtemp(prefix="ae-server-"))
    stdout_path, stderr_path = directory / "stdout", directory / "stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", *args, "--port", "0"],
                                   stdout=stdout, stderr=stderr, env=env or dict(os.environ))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _SERVING.search(stdout_path.read_text())
        if match:
            return RunningServer(process, match.group(1), stdout_path, stderr_path)
        if process.poll() is not None:
            raise ServerDidNotStart(process.returncode, stderr_path.read_text(errors="replace"))
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise AssertionError(f"the server did not start within {timeout} s; stderr:\n{stderr_path.read_text()[-3000:]}")


class ServerDidNotStart(Exception):
    def __init__(self, returncode: int, stderr: str) -> None:
        super().__init__(f"the server exited with {returncode} before serving; stderr:\n{stderr[-3000:]}")
        self.returncode = returncode
        self.stderr = stderr


def metric(server: RunningServer, name: str) -> float:
    """The value of `asyncengine:<name>` on the server's /metrics (the first series of that name)."""
    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    match = re.search(rf"^asyncengine:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"asyncengine:{name} is not on /metrics"
    return float(match.group(1))
