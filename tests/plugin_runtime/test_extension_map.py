"""`asyncengine plugins map` is drawn from marks in the code; these tests keep the marks true.

Every lookup of a registry in the package must sit in a function marked `@reads(registry, role)`, and
every marked function must look that registry up: then the map cannot drift from the code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from asyncengine.cli.reports.extension_map import CONFIG_HOOK, ENTRY_POINT, REGISTRY, build_map

PACKAGE = Path(__file__).resolve().parents[2] / "asyncengine"
# The registry objects by the name code uses for them, and the methods that only register (not reads).
REGISTRY_OBJECTS = {"ModelRegistry": "models", "ModelLoaderRegistry": "model_loaders",
                    "ToolParserManager": "tool_parsers", "ReasoningParserManager": "reasoning_parsers",
                    "AttentionBackendRegistry": "attention_backends",
                    "CustomOpRegistry": "custom_ops", "OpProviderRegistry": "op_providers",
                    "TokenizerRegistry": "tokenizers", "QuantizationRegistry": "quantization",
                    "KVConnectorFactory": "kv_connectors", "MULTIMODAL_REGISTRY": "multimodal_processors"}
REGISTERING = {"register", "claim", "register_model", "register_loader", "register_backend", "register_module",
               "import_tool_parser", "import_reasoning_parser", "owners", "name", "what",
               "register_connector"}


def lookups() -> list[tuple[str, int, str, set[str]]]:
    """(file, line, registry, registries the enclosing function is marked as reading) per lookup."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "plugins_api.py" or "registr" in path.name and path.parent.name in ("registries",):
            continue
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            marked = {decorator.args[0].value for decorator in function.decorator_list
                      if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "reads"}
            for node in ast.walk(function):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in REGISTRY_OBJECTS and node.attr not in REGISTERING):
                    found.append((str(path.relative_to(PACKAGE.parent)), node.lineno, REGISTRY_OBJECTS[node.value.id],
                                  marked))
    return found


def test_every_registry_lookup_is_in_a_function_marked_as_reading_it():
    unmarked = [f"{file}:{line} reads {registry}" for file, line, registry, marked in lookups()
                if registry not in marked and not file.endswith(("registry.py", "registries/__init__.py"))]
    assert unmarked == [], "mark these functions with @reads(registry, role): " + ", ".join(unmarked)
    assert len(lookups()) >= 6


def test_the_map_holds_each_kind_in_the_processes_that_read_it():
    entries = build_map()
    by_process = {}
    for entry in entries:
        by_process.setdefault(entry.process, set()).add((entry.kind, entry.name))
    assert (ENTRY_POINT, "asyncengine.general_plugins") in by_process["engine core"]
    assert (ENTRY_POINT, "asyncengine.endpoint_plugins") not in by_process["worker"]
    assert (REGISTRY, "models") in by_process["frontend"] and (REGISTRY, "models") in by_process["worker"]
    assert (REGISTRY, "model_loaders") in by_process["worker"]
    assert {(REGISTRY, "custom_ops"), (REGISTRY, "op_providers")} <= by_process["worker"]
    assert (REGISTRY, "custom_ops") not in by_process["frontend"]
    # the worker builds the backend; the frontend checks an --attention-backend name before the model loads
    assert (REGISTRY, "attention_backends") in by_process["worker"] and (REGISTRY, "attention_backends") in by_process[
        "frontend"]
    assert (REGISTRY, "tool_parsers") in by_process["frontend"] and (REGISTRY, "tool_parsers") not in by_process["worker"]
    assert (CONFIG_HOOK, "scheduler_cls") in by_process["engine core"]
    for entry in entries:  # each location is a real line of a real file
        file, line = entry.location.rsplit(":", 1)
        assert int(line) <= len((PACKAGE.parent / file).read_text().splitlines()), entry


def test_the_cli_prints_the_map_and_its_markdown():
    result = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "map"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "frontend"
    assert "registries (works only if a general plugin filled it in this process):" in result.stdout
    markdown = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "map", "--markdown"],
                              capture_output=True, text=True, timeout=120)
    assert markdown.stdout.startswith("| frontend | engine core | worker |")


def test_every_module_with_a_reads_mark_is_a_reader_module():
    # The map imports READER_MODULES to collect the marks; a marked module left out of it shows in the
    # map only when something else happened to import it first (the suite's order, not the code).
    from asyncengine.interfaces.tables import READER_MODULES

    marked = set()
    for path in PACKAGE.rglob("*.py"):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", None) == "reads" for d in function.decorator_list):
                marked.add(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    assert marked - set(READER_MODULES) == set(), "add these to READER_MODULES in asyncengine/interfaces/tables.py"


def test_the_docs_page_is_the_generated_map():
    from asyncengine.cli.reports.extension_map import docs_page

    page = (PACKAGE.parent / "docs" / "extension-map.md").read_text()
    assert page == docs_page(build_map()), (
        "docs/extension-map.md is stale: run `asyncengine plugins map --write docs/extension-map.md`")
