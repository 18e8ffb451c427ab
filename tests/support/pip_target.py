"""Test-only packages installed once into a target folder under pip's cache, never into .venv.

`pip_target(name, requirements)` installs the pinned `requirements` without their dependencies (the
virtualenv already has the rest: listing what it lacks keeps the virtualenv's own versions in charge) into
`<pip cache>/asyncengine-test-targets/<name>`, once: later runs find it there. Concurrent runs take a lock,
and a half-finished install (killed) is redone from scratch. The caller appends the folder to sys.path (after
the virtualenv's packages, so nothing there is shadowed).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

INSTALL_TIMEOUT = 300  # seconds; about 20 s for LangChain's client with PyPI reachable


def pip_target(name: str, requirements: list[str], *, marker: str) -> Path:
    """The folder holding `requirements` (pinned, installed with --no-deps); `marker`, a path inside it
    (a package's __init__.py), says the install completed."""
    found = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    # (With pip's cache disabled, PIP_NO_CACHE_DIR, the system's temporary directory keeps it instead.)
    cache = Path(found.stdout.strip()) if found.returncode == 0 and found.stdout.strip() else Path(
        tempfile.gettempdir())
    target = cache / "asyncengine-test-targets" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / marker).is_file():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            started = time.monotonic()
            try:
                subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                str(partial), *requirements], check=True, timeout=INSTALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"pip install of {name} took over {INSTALL_TIMEOUT} s: is PyPI reachable?")
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
            print(f"{name} installed into {target} in {time.monotonic() - started:.0f} s")
    return target
