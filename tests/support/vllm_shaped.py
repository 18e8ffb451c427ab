"""vLLM-shaped test distributions (tests/plugins/vllm-shaped-*), ported and installed.

Each is written against vLLM's API, as a plugin author would bring it. `port_and_install` copies one,
runs `asyncengine plugins port --write` on the copy (the repository's copy stays vLLM-shaped), checks
that the tool mapped every use, and installs the ported copy into a target folder of its own, which a
test puts on the PYTHONPATH of the processes it starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def port(source: Path, *, write: bool) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "asyncengine", "plugins", "port", str(source)] + (["--write"] if write else [])
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def port_and_install(name: str, root: Path, *, unmapped_ok: bool = False) -> tuple[Path, str]:
    """(the install target, the port tool's report) for tests/plugins/<name>, ported under `root`.
    `unmapped_ok`: the distribution is meant to keep uses the tool cannot map."""
    source = _copy(name, root)
    ported = port(source, write=True)
    if ported.returncode != (1 if unmapped_ok else 0):
        raise AssertionError(f"plugins port left uses unmapped in {name}:\n{ported.stdout}{ported.stderr}")
    return _install(root / name, [source]), ported.stdout


def _copy(name: str, root: Path) -> Path:
    source = root / "src" / name
    shutil.copytree(PLUGINS / name, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    return source


def _install(target: Path, sources: list[Path]) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), *map(str, sources)], check=True, capture_output=True,
                   text=True)
    return target


def port_and_install_many(names: tuple[str, ...], root: Path) -> tuple[Path, dict[str, str]]:
    """(one install target, each distribution's port report) for several of tests/plugins/<name>, ported in this
    process and installed by one pip run: what port_and_install does, at one pip start for all of them."""
    from asyncengine.porting.project import port_tree

    sources, reports = [], {}
    for name in names:
        source = _copy(name, root)
        report = port_tree(source)
        report.write()
        if report.num_unmapped:
            raise AssertionError(f"plugins port left uses unmapped in {name}:\n" + "\n".join(report.lines()))
        reports[name] = "\n".join(report.lines()) + (
            f"\nuses of vLLM names: {report.num_mapped} mapped, {report.num_provided} provided by name, "
            f"{report.num_unmapped} use(s) cannot be mapped\n")
        sources.append(source)
    return _install(root / "installed", sources), reports


def environment(*targets: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(str(target) for target in targets)
    env.update(extra)
    return env
