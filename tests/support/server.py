"""Run `asyncengine serve` as a real subprocess on a free port, as a user would.

Each server writes its stdout and stderr into a directory of its own (/tmp/ae-server-*). Once the server
has exited, tests/conftest.py removes the directory, unless a test failed while the server ran: then it
stays, and the end of the run prints where (the failure messages here name it too).
"""

from __future__ import annotations

import os
import re
import shutil
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
class _LogDirectory:
    path: Path
    process: subprocess.Popen
    keep: bool = False  # a test failed while the server ran


_LOG_DIRECTORIES: list[_LogDirectory] = []


def note_test_failure() -> None:
    """A test failed: the logs of every server it could have seen (running, or exited during it) are kept."""
    for directory in _LOG_DIRECTORIES:
        directory.keep = True


def remove_logs_of_exited_servers() -> list[Path]:
    """After each test: remove the log directories of the servers that have exited, but those to keep;
    returns the paths of those kept."""
    kept = []
    for directory in list(_LOG_DIRECTORIES):
        if directory.process.poll() is None:
            continue
        _LOG_DIRECTORIES.remove(directory)
        if directory.keep:
            kept.append(directory.path)
        else:
            shutil.rmtree(directory.path, ignore_errors=True)
    return kept


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
                                 f"its logs: {self.stderr_path.parent}; stderr:\n{self.stderr()[-3000:]}") from None


def start_server(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180,
                 command: tuple[str, ...] = ("serve",)) -> RunningServer:
    """Start `asyncengine serve ARGS --port 0` (`command`: another subcommand, `("launch", "render")`);
    returns once it printed the address it listens on."""
    return launch_server(args, env=env, command=command).wait_until_serving(timeout)


@dataclass
class LaunchedServer:
    """A server process started, not yet known to serve: the test may do other work while it starts."""

    process: subprocess.Popen
    directory: Path

    def wait_until_serving(self, timeout: float = 180) -> RunningServer:
        process, directory = self.process, self.directory
        stdout_path, stderr_path = directory / "stdout", directory / "stderr"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _SERVING.search(stdout_path.read_text())
            if match:
                return RunningServer(process, match.group(1), stdout_path, stderr_path)
            if process.poll() is not None:
                raise ServerDidNotStart(process.returncode, stderr_path.read_text(errors="replace"), directory)
            time.sleep(0.1)
        process.kill()
        process.wait()
        raise AssertionError(f"the server did not start within {timeout} s; its logs: {directory}; "
                             f"stderr:\n{stderr_path.read_text()[-3000:]}")


def launch_server(args: list[str], *, env: dict[str, str] | None = None,
                  command: tuple[str, ...] = ("serve",)) -> LaunchedServer:
    """Start `asyncengine serve ARGS --port 0` and return at once; `wait_until_serving()` then waits for it."""
    directory = Path(tempfile.mkdtemp(prefix="ae-server-"))
    with open(directory / "stdout", "w") as stdout, open(directory / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "asyncengine", *command, *args, "--port", "0"],
                                   stdout=stdout, stderr=stderr, env=env or dict(os.environ))
    _LOG_DIRECTORIES.append(_LogDirectory(directory, process))
    return LaunchedServer(process, directory)


class ServerDidNotStart(Exception):
    def __init__(self, returncode: int, stderr: str, logs: Path) -> None:
        super().__init__(f"the server exited with {returncode} before serving; its logs: {logs}; "
                         f"stderr:\n{stderr[-3000:]}")
        self.returncode = returncode
        self.stderr = stderr


def metric(server: RunningServer, name: str) -> float:
    """The value of `asyncengine:<name>` on the server's /metrics (the first series of that name)."""
    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    match = re.search(rf"^asyncengine:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"asyncengine:{name} is not on /metrics"
    return float(match.group(1))


def requests_finished(server: RunningServer, reason: str) -> float:
    """asyncengine:request_success_total for finish reason `reason` (engine requests, one per completion)."""
    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    match = re.search(rf'^asyncengine:request_success_total\{{[^}}]*finished_reason="{reason}"[^}}]*\}} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; after `timeout` seconds (generous for a loaded machine), fail saying
    what it was still not."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:.0f} s, still not {what}")
        time.sleep(0.1)


ESTABLISHED, LISTEN = "01", "0A"  # TCP states as /proc/net/tcp writes them


def connection_states(pid: int, port: int) -> list[str]:
    """The TCP states of the sockets on local `port` that process `pid` holds open (its file descriptors'
    socket inodes, looked up in /proc/PID/net/tcp and tcp6): ESTABLISHED, LISTEN, "08" CLOSE_WAIT, ..."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    states = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                states.append(fields[3])
    return states
