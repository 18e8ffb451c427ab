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
    if "asyncengine.ops" in sys.modules or importlib.util.find_spec("asyncengine.ops") is not None:
        return
    ops_dir = Path(__file__).resolve().parent.parent / "ops"
    init = ops_dir / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "asyncengine.ops", init, submodule_search_locations=[str(ops_dir)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["asyncengine.ops"] = module
    spec.loader.exec_module(module)


_install_ops_from_source_tree()
