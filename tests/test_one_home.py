"""Each name has one home: the module that defines it. Code imports it from there, and no module but the
public face (`asyncengine.plugins_api`) and package `__init__`s offers a name it only imported.

Read with `ast`, as tests/test_import_layers.py reads the import graph (nothing is imported): a module
"defines" a name with a def, a class or an assignment at module level (also inside a module-level if/try).
An import statement `from M import N`, anywhere in asyncengine/, tests/, bench/ or a first-party plugin's
tests, must name N's home when M is a module under asyncengine/ that only imported N itself.
"""

from __future__ import annotations

import ast
import pathlib

from test_import_layers import PACKAGE_ROOT, _resolve, all_modules

REPOSITORY = PACKAGE_ROOT.parent
# The modules that offer names whose home is elsewhere on purpose: the public face plugins import.
PUBLIC_FACES = ("asyncengine.plugins_api",)


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run at module level: the body, and the blocks of module-level if/try/with."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            inner += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
            found += _module_level(inner)
    return found


def defined_and_imported(name: str, path: pathlib.Path) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """The names `path` defines, and those it imports: local name -> (source module, name there)."""
    defined: set[str] = set()
    imported: dict[str, tuple[str, str]] = {}
    for node in _module_level(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {leaf.id for target in targets for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, path.name == "__init__.py", node)
            for alias in node.names:
                imported.setdefault(alias.asname or alias.name, (source, alias.name))
    return defined, imported


def _scanned() -> dict[str, tuple[set[str], dict[str, tuple[str, str]]]]:
    modules = all_modules()
    return {name: defined_and_imported(name, path) for name, path in modules.items()}


def home_of(module: str, name: str, scanned: dict[str, tuple[set[str], dict[str, tuple[str, str]]]]) -> str:
    """The module that defines `name` as offered by `module`, following the imports that pass it on."""
    seen = set()
    while module in scanned and module not in seen:
        seen.add(module)
        defined, imported = scanned[module]
        if name in defined or name not in imported:
            return module
        module, name = imported[name]
    return module


def test_no_module_offers_in_its_all_a_name_it_only_imported() -> None:
    modules = all_modules()
    scanned = _scanned()
    found = []
    for name, path in modules.items():
        if name in PUBLIC_FACES or path.name == "__init__.py":
            continue
        defined, imported = scanned[name]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                offered = ast.literal_eval(node.value)
                found += [f"{name}: {offered_name} (home {home_of(name, offered_name, scanned)})"
                          for offered_name in offered if offered_name in imported and offered_name not in defined]
    assert found == [], ("names listed in a module's __all__ that the module only imports (a second home):\n"
                         + "\n".join(found) + "\nDrop them from __all__ and import them from their home.")


def test_every_import_names_the_home_of_what_it_imports() -> None:
    modules = all_modules()
    scanned = _scanned()
    files = [*PACKAGE_ROOT.rglob("*.py"), *(REPOSITORY / "tests").rglob("*.py"), *(REPOSITORY / "bench").rglob("*.py"),
             *(REPOSITORY / "plugins").glob("*/tests/*.py")]
    found = []
    for path in sorted(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError:
            continue  # a test's fixture file written broken on purpose
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules):
                continue
            if node.module in PUBLIC_FACES or modules[node.module].name == "__init__.py":
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    continue  # a submodule
                home = home_of(node.module, alias.name, scanned)
                if home != node.module:
                    found.append(f"{path.relative_to(REPOSITORY)}:{node.lineno}: {alias.name} from {node.module}, "
                                 f"whose home is {home}")
    assert found == [], ("imports that take a name from a module that only imported it:\n" + "\n".join(found)
                         + "\nImport each name from its home (or, in a plugin, from asyncengine.plugins_api).")


def test_the_checks_follow_a_name_through_the_modules_that_pass_it_on(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home.py"
    home.write_text("class Thing:\n    pass\n")
    relay = tmp_path / "relay.py"
    relay.write_text("from asyncengine.home import Thing\n__all__ = ['Thing']\n")
    scanned = {"asyncengine.home": defined_and_imported("asyncengine.home", home),
               "asyncengine.relay": defined_and_imported("asyncengine.relay", relay)}
    assert home_of("asyncengine.relay", "Thing", scanned) == "asyncengine.home"
    assert home_of("asyncengine.home", "Thing", scanned) == "asyncengine.home"
    relay.write_text("from asyncengine.home import Thing\nThing = Thing\n")  # a definition of its own: a home
    scanned["asyncengine.relay"] = defined_and_imported("asyncengine.relay", relay)
    assert home_of("asyncengine.relay", "Thing", scanned) == "asyncengine.relay"
