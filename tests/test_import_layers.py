"""Imports point down: the layers of asyncengine/, declared once here, and the test that holds the code to them.

Every module under asyncengine/ is read with `ast` (nothing is imported), and every `import` and `from ... import`
in it counts: at module level, inside functions and classes, and under `if TYPE_CHECKING:`. Type-only imports are
included on purpose: an annotation that names a role's class still makes the lower layer know about the higher one
(the reader has to climb to understand it, and mypy follows it), and `TYPE_CHECKING` must not become the way an
upward dependency hides. Relative imports are resolved against the importing module. `from pkg import name` is an
edge to `pkg.name` when that is a module, otherwise to `pkg`; a parent package's `__init__` is not an edge of its
own (Python runs it, but it only re-exports its children, and counting it would make every package a cycle).
A class path held in a string ("asyncengine.worker.worker:Worker", imported when first needed) is not an import:
naming a default implementation by path is how a lower layer stays ignorant of it.

The rules, one test each:
- a module imports only from its own layer or the layers below it;
- no import cycle between modules (a strongly connected component of the module graph with more than one module),
  lazy imports included: a cycle hidden inside functions is still two modules that cannot be read apart;
- no cycle at import time through a package's `__init__` (a second graph: only the imports that run on import,
  each with the `__init__`s it runs first), which the module graph cannot see and Python meets as a partially
  initialised module, depending on which module is imported first;
- every package and top-level module under asyncengine/ is placed in a layer, and every placed name exists;
- folders, as modules: a folder (a package directly under asyncengine/, or a top-level module) sits on one layer
  whole, imports no folder of a higher layer, and no two folders import each other, directly or round a loop (a
  folder is the unit a reader opens; a loop between two means neither can be read first);
- no module whose body is only imports (re-exports of names that live elsewhere), other than `plugins_api` (the
  public face) and package `__init__`s: each name has one home, and code imports it from there.

`asyncengine.ops` (the kernels, shipped from ops/ by a package-dir mapping) is below every layer: anything may use
a kernel, and ops/ imports no engine code.

Run `python tests/test_import_layers.py [path/to/asyncengine]` to print the upward imports and cycles as a report.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from dataclasses import dataclass

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1] / "asyncengine"

# The layers, bottom to top (docs/architecture.md draws them). A name places that module, or that package with
# everything under it unless a longer name places a part of it elsewhere; "asyncengine" places only the root
# package's own __init__. Within a layer any import is allowed (the cycle rule still holds there).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "floor",
        (
            "asyncengine.errors",
            "asyncengine._version",
            "asyncengine._ops_path",
            "asyncengine.config",
            "asyncengine.interfaces",
            "asyncengine.wire",
            "asyncengine.runtime",
            "asyncengine.parallel_state",
            "asyncengine.outputs",
            "asyncengine.sampling_params",
            "asyncengine.structured_output_spec",
            "asyncengine.json_nesting",
            # Pooling's params, runner and pooler choice, built-in poolers (torch only) and outputs.
            "asyncengine.pooling",
        ),
    ),
    # The platform phase is the plugin runtime's first: the built-in platforms (cpu, cuda) are chosen among the
    # platform plugins there, and import only the floor (the Platform interface is asyncengine.interfaces).
    ("plugin runtime", ("asyncengine.plugin_runtime", "asyncengine.platforms")),
    (
        "kernels' users",
        (
            "asyncengine.attention",
            "asyncengine.models",
            "asyncengine.loader",
            "asyncengine.kv_transfer",
            "asyncengine.structured_output",
            "asyncengine.lora",
        ),
    ),
    # The roles, in the order one spawns the next: the engine core runs the worker (in a thread under `uni`), the
    # frontend runs the engine core (in its own event loop under `in_process`); never the reverse.
    ("worker", ("asyncengine.worker",)),
    ("engine core", ("asyncengine.engine_core",)),
    ("frontend", ("asyncengine.frontend",)),
    (
        "server and CLI",
        (
            "asyncengine.server",
            "asyncengine.cli",
            "asyncengine.porting",
            "asyncengine.compat",  # vLLM's EngineArgs/LLMEngine and older attention selector, over our engine
            "asyncengine.plugins_api",
            "asyncengine.__main__",
            "asyncengine",
        ),
    ),
)
# Below every layer: the kernels (ops/, importable as asyncengine.ops).
BELOW_ALL = ("asyncengine.ops",)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    line: int
    target: str  # dotted module name (a module or package under asyncengine/)


def module_name(path: pathlib.Path, root: pathlib.Path | None = None) -> str:
    parts = list(path.relative_to((root or PACKAGE_ROOT).parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: pathlib.Path | None = None) -> dict[str, pathlib.Path]:
    root = root or PACKAGE_ROOT
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "asyncengine" or alias.name.startswith("asyncengine."):
                    found.append(Import(name, node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, is_package, node)
            if not (source == "asyncengine" or source.startswith("asyncengine.")):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append(Import(name, node.lineno, submodule if submodule in modules else source))
    # One edge per (line, target): `from x import a, b` names x once.
    return sorted(set(found), key=lambda imp: (imp.line, imp.target))


def module_graph() -> tuple[dict[str, pathlib.Path], list[Import]]:
    modules = all_modules()
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: dict[str, pathlib.Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name == "asyncengine" or alias.name.startswith("asyncengine.")]
    source = _resolve(name, is_package, node)
    if not (source == "asyncengine" or source.startswith("asyncengine.")):
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:index]) for index in range(1, len(parts))]


def import_time_graph(root: pathlib.Path | None = None) -> tuple[dict[str, pathlib.Path], list[Import]]:
    """The imports that run while a module is being imported (not those inside functions, nor under
    `if TYPE_CHECKING:`), each with the package `__init__`s it runs first: importing `a.b.c` runs `a` and
    `a.b` unless the importer is inside them (then they are running already). A cycle here is one Python
    can meet at import time, as a partially initialised module, depending on which module is imported
    first; the module graph above cannot see it, because it leaves the `__init__`s out."""
    modules = all_modules(root)
    edges: list[Import] = []

    def visit(name: str, is_package: bool, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # runs when called, not when imported
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(name, is_package, node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                own = {name, *_ancestors(name)}
                for target in _targets(name, is_package, node, modules):
                    for module in [*_ancestors(target), target]:
                        if module in modules and module not in own:
                            edges.append(Import(name, node.lineno, module))
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):  # class bodies, if/try/with blocks
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(name, is_package, [n for n in inner if isinstance(n, ast.stmt)]
                          + [stmt for h in inner if isinstance(h, ast.ExceptHandler) for stmt in h.body])

    for name, path in modules.items():
        visit(name, path.name == "__init__.py", ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body)
    return modules, sorted(set(edges), key=lambda imp: (imp.importer, imp.line, imp.target))


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, layer name) of a module, None when it is not placed; -1 for the kernels below every layer."""
    if any(module == name or module.startswith(name + ".") for name in BELOW_ALL):
        return (-1, "kernels (asyncengine.ops)")
    best: tuple[int, int, str] | None = None  # (length of the placing name, layer index, layer name)
    for index, (layer, names) in enumerate(LAYERS):
        for name in names:
            matches = module == name if name == "asyncengine" else module == name or module.startswith(name + ".")
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), index, layer)
    return None if best is None else (best[1], best[2])


def upward_imports(edges: list[Import]) -> list[tuple[Import, str, str]]:
    """Every import from a lower layer to a higher one, with both layers' names."""
    found = []
    for imp in edges:
        source, target = layer_of(imp.importer), layer_of(imp.target)
        if source is not None and target is not None and target[0] > source[0]:
            found.append((imp, source[1], target[1]))
    return found


def import_cycles(modules: dict[str, pathlib.Path], edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of the module graph with more than one module (Tarjan, iterative)."""
    successors: dict[str, set[str]] = {name: set() for name in modules}
    for imp in edges:
        if imp.target in modules and imp.target != imp.importer:
            successors[imp.importer].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(successors):
        if root in index:
            continue
        work = [(root, iter(sorted(successors[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def folder_of(module: str) -> str:
    """The folder a module is in: its package directly under asyncengine/ (asyncengine.models.layers.norm ->
    asyncengine.models), or the module itself when it is a top-level module (asyncengine.errors)."""
    return ".".join(module.split(".")[:2])


def folder_graph(edges: list[Import]) -> list[Import]:
    """One edge per (importing folder, imported folder), naming the first module import that makes it."""
    found: dict[tuple[str, str], Import] = {}
    for imp in sorted(edges, key=lambda imp: (imp.importer, imp.line, imp.target)):
        source, target = folder_of(imp.importer), folder_of(imp.target)
        if source != target and (source, target) not in found:
            found[(source, target)] = Import(source, imp.line, target)
    return list(found.values())


def folders_straddling_layers(modules: dict[str, pathlib.Path]) -> dict[str, list[str]]:
    """Folder -> the layers its modules sit on, for every folder whose modules sit on more than one."""
    layers: dict[str, set[str]] = {}
    for module in modules:
        placed = layer_of(module)
        layers.setdefault(folder_of(module), set()).add(placed[1] if placed else "(unplaced)")
    return {folder: sorted(names) for folder, names in sorted(layers.items()) if len(names) > 1}


def only_reexports(path: pathlib.Path) -> bool:
    """Whether a module's body, past its docstring, is only imports, `__all__` and aliases (`X = Y`): it
    defines nothing, so every name it offers has its home elsewhere."""
    body = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    imports = 0
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports += 1
            continue
        if isinstance(node, ast.Assign) and all(isinstance(target, ast.Name) for target in node.targets) and (
                any(target.id == "__all__" for target in node.targets if isinstance(target, ast.Name))
                or isinstance(node.value, (ast.Name, ast.Attribute))):
            continue
        return False
    return imports > 0


# The modules allowed to be only re-exports: the public face plugins import, and package __init__s.
REEXPORTS_ALLOWED = ("asyncengine.plugins_api",)


def _describe_upward(imp: Import, source_layer: str, target_layer: str, modules: dict[str, pathlib.Path]) -> str:
    path = modules[imp.importer].relative_to(PACKAGE_ROOT.parent)
    return (
        f"{path}:{imp.line}: {imp.importer} (layer {source_layer!r}) imports {imp.target} (layer {target_layer!r}), "
        "a higher layer"
    )


def _describe_cycle(component: list[str], edges: list[Import], modules: dict[str, pathlib.Path]) -> str:
    members = set(component)
    inner = [imp for imp in edges if imp.importer in members and imp.target in members and imp.importer != imp.target]
    lines = [
        f"    {modules[imp.importer].relative_to(PACKAGE_ROOT.parent)}:{imp.line}: {imp.importer} -> {imp.target}"
        for imp in inner
    ]
    return f"cycle between {len(component)} modules: {', '.join(component)}\n" + "\n".join(lines)


def test_imports_point_down() -> None:
    modules, edges = module_graph()
    found = upward_imports(edges)
    if found:
        report = "\n".join(_describe_upward(imp, low, high, modules) for imp, low, high in found)
        raise AssertionError(
            f"{len(found)} import(s) point up a layer (layers bottom to top: "
            f"{', '.join(name for name, _ in LAYERS)}):\n{report}\n"
            "A lower layer must not know a higher one. Move what both need down (a class a plugin subclasses to "
            "asyncengine/interfaces/, a message type to asyncengine/wire/), or invert it: let the higher layer pass "
            "the object or the check in. If the layer of a whole package is wrong, change LAYERS in "
            "tests/test_import_layers.py and docs/architecture.md together."
        )


def test_no_import_cycles() -> None:
    modules, edges = module_graph()
    cycles = import_cycles(modules, edges)
    if cycles:
        report = "\n".join(_describe_cycle(component, edges, modules) for component in cycles)
        raise AssertionError(
            f"{len(cycles)} import cycle(s) (imports inside functions count):\n{report}\n"
            "Break each cycle: move what both modules need into a third module below them, or pass it in."
        )


def test_no_import_cycle_through_a_package_init_at_import_time() -> None:
    modules, edges = import_time_graph()
    cycles = import_cycles(modules, edges)
    if cycles:
        report = "\n".join(_describe_cycle(component, edges, modules) for component in cycles)
        raise AssertionError(
            f"{len(cycles)} import cycle(s) at import time, through a package's __init__ (importing a.b.c runs "
            f"a/__init__.py and a/b/__init__.py first):\n{report}\n"
            "Whichever module is imported first meets the other half-initialised. Make the __init__ import its "
            "submodules lazily (a module-level __getattr__), or import the submodule the code needs directly."
        )


def test_every_package_is_placed_in_a_layer() -> None:
    modules = all_modules()
    unplaced = sorted(name for name in modules if layer_of(name) is None)
    placed = [name for _, names in LAYERS for name in names]
    duplicated = sorted({name for name in placed if placed.count(name) > 1})
    stale = sorted(name for name in placed if not any(m == name or m.startswith(name + ".") for m in modules))
    problems = []
    if unplaced:
        problems.append(f"not placed in any layer: {', '.join(unplaced)}")
    if duplicated:
        problems.append(f"placed twice: {', '.join(duplicated)}")
    if stale:
        problems.append(f"placed but no such module or package under asyncengine/: {', '.join(stale)}")
    if problems:
        raise AssertionError(
            "; ".join(problems) + ". Place every package and top-level module under asyncengine/ in exactly one "
            "layer of LAYERS in tests/test_import_layers.py (and draw it in docs/architecture.md)."
        )


def test_each_folder_sits_on_one_layer() -> None:
    straddling = folders_straddling_layers(all_modules())
    assert not straddling, (
        "folders whose modules sit on different layers: " + "; ".join(
            f"{folder} ({', '.join(layers)})" for folder, layers in straddling.items())
        + ". Move the module that sits on another layer into a folder of that layer (what the floor needs from "
        "a role's folder goes to asyncengine/interfaces/, asyncengine/config/ or asyncengine/wire/), and place "
        "whole folders in LAYERS.")


def test_no_folder_imports_a_folder_of_a_higher_layer() -> None:
    modules, edges = module_graph()
    found = upward_imports(folder_graph(edges))
    report = "\n".join(f"{imp.importer} (layer {low!r}) imports {imp.target} (layer {high!r})"
                       for imp, low, high in found)
    assert not found, f"{len(found)} folder(s) import a folder of a higher layer:\n{report}"


def test_no_import_cycle_between_folders() -> None:
    modules, edges = module_graph()
    folder_edges = folder_graph(edges)
    folders = {folder_of(name): modules[name] for name in modules}
    cycles = import_cycles(folders, folder_edges)
    if cycles:
        lines = []
        for component in cycles:
            members = set(component)
            lines.append(f"cycle between folders {', '.join(component)}:")
            lines += [f"    {imp.importer} -> {imp.target}: {first}"
                      for imp in folder_edges if imp.importer in members and imp.target in members
                      for first in [next(f"{e.importer}:{e.line} imports {e.target}" for e in edges
                                         if folder_of(e.importer) == imp.importer and folder_of(e.target) == imp.target)]]
        raise AssertionError(
            f"{len(cycles)} import cycle(s) between folders:\n" + "\n".join(lines) + "\n"
            "Move what both folders need into the one below (or a floor folder), or pass it in.")


def test_no_module_is_only_reexports() -> None:
    modules = all_modules()
    found = sorted(name for name, path in modules.items()
                   if path.name != "__init__.py" and name not in REEXPORTS_ALLOWED and only_reexports(path))
    assert found == [], (
        f"modules that only re-export names whose home is elsewhere: {', '.join(found)}. Import each name from "
        "its home, and delete the module (asyncengine.plugins_api is the one public face that re-exports).")


def test_the_folder_checks_see_a_cycle_a_straddling_folder_and_a_reexport_module(tmp_path: pathlib.Path) -> None:
    edges = [Import("asyncengine.wire.messages", 3, "asyncengine.lora.request"),
             Import("asyncengine.lora.pool", 5, "asyncengine.wire.messages")]
    folder_edges = folder_graph(edges)
    assert {(imp.importer, imp.target) for imp in folder_edges} == {
        ("asyncengine.wire", "asyncengine.lora"), ("asyncengine.lora", "asyncengine.wire")}
    folders = {"asyncengine.wire": tmp_path, "asyncengine.lora": tmp_path}
    assert import_cycles(folders, folder_edges) == [["asyncengine.lora", "asyncengine.wire"]]
    # A folder is placed by its top-level name; a module of it placed elsewhere makes it straddle.
    assert layer_of("asyncengine.lora.pool") == layer_of("asyncengine.lora")
    reexport = tmp_path / "reexport.py"
    reexport.write_text('"""Doc."""\nfrom __future__ import annotations\nfrom asyncengine.interfaces.models import '
                        'ModelRegistry\nRegistry = ModelRegistry\n__all__ = ["ModelRegistry", "Registry"]\n')
    assert only_reexports(reexport)
    reexport.write_text(reexport.read_text() + "def helper():\n    return ModelRegistry\n")
    assert not only_reexports(reexport)


def test_the_checker_sees_lazy_type_only_and_relative_imports(tmp_path: pathlib.Path) -> None:
    """The scan itself: a lazy import, a TYPE_CHECKING import and a relative import are all edges."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..frontend import llm\n"
        "if TYPE_CHECKING:\n"
        "    from asyncengine.server.app import build_app\n"
        "def later():\n"
        "    import asyncengine.engine_core.core\n"
    )
    fake = tmp_path / "example.py"
    fake.write_text(source)
    modules = {name: fake for name in ("asyncengine.wire.sibling", "asyncengine.frontend.llm", "asyncengine.wire")}
    found = {(imp.line, imp.target) for imp in imports_of("asyncengine.wire.example", fake, modules)}
    assert found == {
        (2, "asyncengine.wire.sibling"),
        (3, "asyncengine.frontend.llm"),
        (5, "asyncengine.server.app"),
        (7, "asyncengine.engine_core.core"),
    }
    upward = {(imp.target, high) for imp, _, high in upward_imports(
        [Import("asyncengine.wire.example", line, target) for line, target in found])}
    assert upward == {
        ("asyncengine.frontend.llm", "frontend"),
        ("asyncengine.server.app", "server and CLI"),
        ("asyncengine.engine_core.core", "engine core"),
    }


def test_the_checker_finds_a_cycle_through_three_modules() -> None:
    modules = {name: PACKAGE_ROOT for name in ("a", "b", "c", "d")}
    edges = [Import("a", 1, "b"), Import("b", 1, "c"), Import("c", 1, "a"), Import("c", 2, "d")]
    assert import_cycles(modules, edges) == [["a", "b", "c"]]


def test_the_import_time_check_sees_a_cycle_through_a_package_init(tmp_path: pathlib.Path) -> None:
    """The shape of a real one (c8ac7c8^): config.model imports interfaces.registry, which runs the eager
    interfaces/__init__, which imports interfaces.model_loader, which imports config.model back."""
    root = tmp_path / "asyncengine"
    files = {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/model.py": "from asyncengine.interfaces.registry import Registry\n",
        "interfaces/__init__.py": "from asyncengine.interfaces import model_loader\n",
        "interfaces/registry.py": "class Registry: ...\n",
        "interfaces/model_loader.py": "from asyncengine.config.model import ModelConfig\n",
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    modules, edges = import_time_graph(root)
    assert import_cycles(modules, edges) == [
        ["asyncengine.config.model", "asyncengine.interfaces", "asyncengine.interfaces.model_loader"]]
    # The module graph leaves the __init__ out: it sees no cycle there.
    assert import_cycles(modules, [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]) == []
    # A lazy __init__ (the fix) has no import-time edge to its submodules.
    (root / "interfaces/__init__.py").write_text(
        "def __getattr__(name):\n    from asyncengine.interfaces import model_loader\n    return model_loader\n")
    assert import_cycles(*import_time_graph(root)) == []


if __name__ == "__main__":
    if len(sys.argv) > 1:  # another checkout's asyncengine/ (to count an older commit's graph)
        PACKAGE_ROOT = pathlib.Path(sys.argv[1]).resolve()
    all_mods, all_edges = module_graph()
    upward = upward_imports(all_edges)
    for imp, low, high in upward:
        print(_describe_upward(imp, low, high, all_mods))
    cycles = import_cycles(all_mods, all_edges)
    for component in cycles:
        print(_describe_cycle(component, all_edges, all_mods))
    init_mods, init_edges = import_time_graph()
    init_cycles = import_cycles(init_mods, init_edges)
    for component in init_cycles:
        print("at import time, through a package __init__: " + _describe_cycle(component, init_edges, init_mods))
    cycles += init_cycles
    folder_edges = folder_graph(all_edges)
    folder_upward = upward_imports(folder_edges)
    for imp, low, high in folder_upward:
        print(f"folder {imp.importer} (layer {low!r}) imports folder {imp.target} (layer {high!r})")
    folder_cycles = import_cycles({folder_of(name): path for name, path in all_mods.items()}, folder_edges)
    for component in folder_cycles:
        print(f"cycle between folders: {', '.join(component)}")
    for folder, layers in folders_straddling_layers(all_mods).items():
        print(f"folder {folder} straddles layers: {', '.join(layers)}")
    reexports = sorted(name for name, path in all_mods.items()
                       if path.name != "__init__.py" and name not in REEXPORTS_ALLOWED and only_reexports(path))
    for name in reexports:
        print(f"only re-exports: {name}")
    print(f"{len(upward)} upward imports, {len(cycles)} cycles, {len(all_mods)} modules, {len(all_edges)} imports; "
          f"folders: {len(folder_upward)} upward, {len(folder_cycles)} cycles, {len(folder_edges)} edges; "
          f"{len(reexports)} re-export-only modules")
    sys.exit(1 if upward or cycles or folder_upward or folder_cycles or reexports else 0)
