"""Make `asyncengine.ops` importable when the engine runs from a source tree on PYTHONPATH.

Installed (editable or not), pyproject's package-dir maps the repository's `ops/` folder to
`asyncengine.ops`. From a bare source tree (the GPU machine runs that way) nothing provides that
mapping, so we load `ops/` under its public name ourselves, once, and only when the normal finders fail.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _install_ops_from_source_tree() -> None:
    if "asyncengine.ops" in sys.modules:
        return
    tree = Path(__file__).resolve().parent.parent
    ops_dir = tree / "ops"
    init = ops_dir / "__init__.py"
    found = importlib.util.find_spec("asyncengine.ops")
    if not (tree / "pyproject.toml").is_file() or not init.is_file():
        return  # an installed wheel: its asyncengine/ops is the package (and a top-level ops/ is someone else's)
    if found is not None and found.origin is not None and Path(found.origin).resolve() == init:
        return
    # A source tree whose ops/ the finders do not give: none at all, or another tree's (an editable install of
    # another checkout maps the name to its own ops/, and that tree's kernels would run with this tree's engine:
    # an ABAB benchmark of an exported older tree on PYTHONPATH met exactly that).
    spec = importlib.util.spec_from_file_location(
        "asyncengine.ops", init, submodule_search_locations=[str(ops_dir)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["asyncengine.ops"] = module
    spec.loader.exec_module(module)
    parent = sys.modules.get("asyncengine")
    if parent is not None:  # `import asyncengine.ops` then reads the attribute, as after a normal import
        parent.ops = module  # type: ignore[attr-defined]


_install_ops_from_source_tree()
