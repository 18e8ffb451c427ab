"""Real plugin distributions (tests/plugins/*), installed once per session, each into a target of its
own: a test puts exactly the ones it needs on the PYTHONPATH of the processes it starts. Nothing is
installed into .venv, so a deliberately broken plugin cannot break later runs or `make serve`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS_DIR = Path(__file__).resolve().parent.parent / "plugins"


@pytest.fixture(scope="session")
def plugin_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-dists")
    installed: dict[str, Path] = {}

    def install(name: str) -> Path:
        if name not in installed:
            source = root / "src" / name
            shutil.copytree(PLUGINS_DIR / name, source)  # build in a copy: the repository stays clean
            target = root / name
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                 "--no-index", "--target", str(target), str(source)],
                check=True, capture_output=True, text=True,
            )
            installed[name] = target
        return installed[name]

    return install


@pytest.fixture
def plugin_env(plugin_target):
    """Environment for a process that sees exactly the named plugin distributions."""

    def make(*names: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
        env["PYTHONPATH"] = os.pathsep.join(str(plugin_target(name)) for name in names)
        env.update(extra)
        return env

    return make


@pytest.fixture
def cli():
    """Run `asyncengine ARGS...` as a user would, in `env`."""

    def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True, text=True,
                              env=env, timeout=timeout)

    return run
