"""The package as installed and as a bare source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "asyncengine").rglob("__init__.py")
    }
    assert found | {"asyncengine.ops"} == listed


def test_ops_import_from_a_bare_source_tree():
    # -S skips site-packages' .pth files, hence the editable install's finder: only PYTHONPATH counts,
    # as on the GPU machine, where the source tree travels without being installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])}
    code = "import asyncengine.ops.paged_attention as m, asyncengine.ops as o; print(o.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(ROOT / "ops" / "__init__.py")


def test_another_source_tree_on_pythonpath_gets_its_own_ops(tmp_path):
    """An exported older tree run beside this checkout's editable install (bench ABABs do that) imports its own
    ops/: the install's finder maps asyncengine.ops to this checkout's folder, whose kernels would otherwise run
    under the other tree's engine."""
    import shutil

    other = tmp_path / "other-tree"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "asyncengine", other / "asyncengine", ignore=ignore)
    shutil.copytree(ROOT / "ops", other / "ops", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", other / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(other)}
    code = "import asyncengine.ops.paged_attention as m, asyncengine.ops as o; print(o.__file__, m.__file__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(other / "ops" / "__init__.py"), str(other / "ops" / "paged_attention.py")]
