"""The floor (asyncengine/interfaces/): what it may import, that it loads no torch, that the public faces
(plugins_api, the parsers' package) give its objects, and that import_by_path raises the error its caller names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.errors import ConfigError
from asyncengine.interfaces.imports import ClassPathImportError, import_by_path

FLOOR = Path(__file__).resolve().parent.parent / "asyncengine" / "interfaces"
# What the floor may import from asyncengine: itself, the config, the errors and the request data it types.
ALLOWED = ("asyncengine.interfaces", "asyncengine.config", "asyncengine.errors", "asyncengine.structured_output_spec")
TORCH_MODULE = "torch_bases.py"  # the one module of the floor that imports torch


def python_output(code: str, *, timeout: int) -> str:
    """What a fresh interpreter running `code` prints (it must succeed)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def imports_of(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, for annotations only) of every import in `path`, inside functions and
    `if TYPE_CHECKING:` blocks included (the last are for annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, id(node) in typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, id(node) in typing_only))
    return found


def test_the_floor_imports_only_config_errors_and_itself_and_torch_only_in_one_module():
    wrong = []
    for path in sorted(FLOOR.glob("*.py")):
        for line, module, typing_only in imports_of(path):
            upward = module.startswith("asyncengine") and not module.startswith(ALLOWED)
            # torch types in annotations are fine: importing the module never runs them
            torch = module.split(".")[0] == "torch" and path.name != TORCH_MODULE and not typing_only
            if upward or torch:
                wrong.append(f"{path.name}:{line} imports {module}")
    assert wrong == []


def test_importing_the_floor_and_reading_its_names_loads_no_torch():
    names = [name for name in importlib.import_module("asyncengine.interfaces").__all__ if name != "CustomOp"]
    code = ("import sys, asyncengine.interfaces as floor\n"
            f"for name in {names!r}: getattr(floor, name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    stdout = python_output(code, timeout=120)
    assert stdout.strip() == "[]"


@pytest.mark.parametrize(("old", "name"), [
    ("asyncengine.plugins_api", "LogitsProcessor"),
    ("asyncengine.plugins_api", "CustomOp"),
    ("asyncengine.server.parsers", "ToolParser"),
    ("asyncengine.server.parsers", "ToolParserManager"),
    ("asyncengine.plugins_api", "ToolParserManager"),
    ("asyncengine.plugins_api", "TokenizerRegistry"),
    ("asyncengine.plugins_api", "AdditionalConfigRegistry"),
])
def test_the_public_faces_give_the_floors_object(old, name):
    # The floor is each name's one home; plugins_api and the parsers' package __init__ offer the same object.
    import asyncengine.interfaces as floor

    assert getattr(importlib.import_module(old), name) is getattr(floor, name)


def test_every_table_is_the_floors_and_asking_for_them_imports_nothing_above_it():
    # A table named by "pkg.mod:attr" would be imported here, from a layer the import graph cannot see.
    code = ("import sys\n"
            "from asyncengine.interfaces.tables import all_registries\n"
            "all_registries()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('asyncengine.server', 'asyncengine.frontend', "
            "'asyncengine.plugin_runtime', 'asyncengine.models', 'asyncengine.worker'))))")
    stdout = python_output(code, timeout=120)
    assert stdout.strip() == "[]"


@pytest.mark.parametrize(("table", "key", "old", "name"), [
    ("ToolParserManager", "json_tags", "asyncengine.server.parsers.tool_parsers", "JsonTagsToolParser"),
    ("ToolParserManager", "hermes", "asyncengine.server.parsers.tool_parsers", "JsonTagsToolParser"),
    ("ReasoningParserManager", "think", "asyncengine.server.parsers.reasoning_parsers", "ThinkReasoningParser"),
    ("TokenizerRegistry", "auto", "asyncengine.frontend.tokenizer", "HFAutoTokenizer"),
])
def test_a_built_in_entry_the_floor_names_by_path_is_the_higher_layers_class(table, key, old, name):
    import asyncengine.interfaces as floor
    from asyncengine.interfaces.imports import import_by_path

    entry = getattr(floor, table).registered(key)
    assert import_by_path(entry.implementation, what=key) is getattr(importlib.import_module(old), name)


def test_the_built_in_op_providers_are_in_the_floors_table_and_get_their_options_above_it():
    from asyncengine.interfaces.custom_op_registry import BUILT_IN_PROVIDERS, OpProviderRegistry
    from asyncengine.models.layers import op_registry

    assert set(BUILT_IN_PROVIDERS) <= set(OpProviderRegistry.keys())
    ops = ("rms_norm", "rotary", "silu_and_mul", "sample", "fused_moe")
    op_registry.set_op_priority({op: [op_registry.NATIVE] for op in ops})  # no platform needed to order them
    try:
        for op in ops:  # the order reads each provider's options: a built-in without them fails here
            assert op_registry.provider_order(op)[0][0] == op_registry.NATIVE
    finally:
        op_registry.set_op_priority(None)


def test_a_parser_plugin_loads_through_the_floor_alone_whatever_was_imported_first():
    # The loader is the floor's own (interfaces/parser_plugins.py): no server module has to be imported first.
    code = ("import sys\n"
            "from asyncengine.interfaces.parsers import ToolParserManager\n"
            "print(ToolParserManager.import_tool_parser('json').__name__)\n"
            "print(sorted(m for m in sys.modules if m.startswith('asyncengine.server')))")
    stdout = python_output(code, timeout=120)
    assert stdout.strip().splitlines() == ["json", "[]"]


def test_importing_any_module_changes_no_process_wide_state():
    """Hooks are installed by the start-up phase that owns them, never by an import: after importing every
    module under asyncengine/ (those that used to install a hook included: the custom ops' platform lookup,
    the parsers' plugin loader), the platform is still unresolved and nothing told the floor otherwise."""
    code = ("import importlib, pathlib, sys\n"
            "import asyncengine\n"
            "root = pathlib.Path(asyncengine.__file__).parent\n"
            "skipped = []\n"
            "for path in sorted(root.rglob('*.py')):\n"
            "    parts = list(path.relative_to(root.parent).with_suffix('').parts)\n"
            "    if parts[-1] in ('__init__', '__main__'):\n"
            "        parts.pop() if parts[-1] == '__init__' else None\n"
            "        if path.name == '__main__.py': continue\n"
            "    try:\n"
            "        importlib.import_module('.'.join(parts))\n"
            "    except ModuleNotFoundError as exc:\n"
            "        if (exc.name or '').startswith('asyncengine'): raise\n"
            "        skipped.append(exc.name)  # an optional package this machine lacks\n"
            "from asyncengine.interfaces import custom_op_registry\n"
            "from asyncengine.config import vllm_views\n"
            "from asyncengine.plugin_runtime import platform_resolution\n"
            "print(custom_op_registry._dispatch_platform, vllm_views._platform, platform_resolution._current)\n"
            "try:\n"
            "    custom_op_registry.dispatch_platform()\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__)\n")
    stdout = python_output(code, timeout=240)
    assert stdout.strip().splitlines() == ["None [None] None", "StartupError"]


def test_the_built_in_worker_is_a_worker_base():
    from asyncengine.interfaces import WorkerBase
    from asyncengine.worker.worker import Worker

    assert issubclass(Worker, WorkerBase)


def test_import_by_path_raises_the_error_its_caller_names():
    with pytest.raises(ClassPathImportError, match="a thing: importing 'no_such_module_xyz' failed"):
        import_by_path("no_such_module_xyz:Thing", what="a thing")
    with pytest.raises(ConfigError, match="my_option: 'not a path' is not of the form") as caught:
        import_by_path("not a path", what="my_option", error=lambda message: ConfigError(message, field="my_option"))
    assert caught.value.field == "my_option"
    assert import_by_path("asyncengine.interfaces.roles:WORKER", what="x") == "worker"
