"""`import vllm`, `import vllm.x.y` and `import vllm.x as y`: the module imported whole, used through
attribute chains (`vllm.ModelRegistry.register_model(...)`, `y.Scheduler`).

Each chain whose head the table maps is rewritten to our fully qualified name
(`asyncengine.plugins_api.ModelRegistry.register_model(...)`): a qualified name cannot collide with a
name the plugin already has. The import statement then imports our module (`import
asyncengine.plugins_api`), and keeps the vLLM import only while some use of it stays unmapped; each of
those is listed with its line. An import none of whose uses maps is left as it was, and listed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from asyncengine.porting import table


@dataclass(frozen=True)
class _Use:
    """One use of a bare import's local name: the chain `local.a.b...` as far as it goes, the node to
    replace (the part the table maps, or None) and what it becomes."""

    dotted: str
    source: str  # the head of `dotted` the table maps ('' when none)
    node: ast.expr
    replacement: str | None
    target_module: str | None


class ModuleUses:
    """Every load of each name in a module, with the attribute chain above it (built once per file)."""

    def __init__(self, tree: ast.AST) -> None:
        # Several statements can bind one local name (`import vllm` and `import vllm.envs` both bind
        # `vllm`): its uses are rewritten once, at the first; per name, (uses mapped, uses in all).
        self.ported: dict[str, tuple[int, int]] = {}
        # (the statement's parent, our module) already imported: once per block, not per statement.
        self.imported: set[tuple[int, str]] = set()
        self._parents: dict[int, ast.AST] = {}
        self._loads: dict[str, list[ast.Name]] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self._parents[id(child)] = parent
            if isinstance(parent, ast.Name) and isinstance(parent.ctx, ast.Load):
                self._loads.setdefault(parent.id, []).append(parent)

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self._parents.get(id(node))

    def chains(self, local: str) -> list[list[ast.expr]]:
        """For each load of `local`: [the Name, local.a, local.a.b, ...] (the Attribute nodes above it)."""
        found = []
        for name in self._loads.get(local, []):
            chain: list[ast.expr] = [name]
            parent = self._parents.get(id(name))
            while isinstance(parent, ast.Attribute) and parent.value is chain[-1]:
                chain.append(parent)
                parent = self._parents.get(id(parent))
            found.append(chain)
        return found


def _mapped(parts: list[str], bound: int) -> tuple[int, str, str] | None:
    """The longest head of the dotted `parts` (at least the `bound` parts the local name stands for)
    that the table maps: (its length, our module, our name)."""
    for length in range(len(parts), bound - 1, -1):
        head = parts[:length]
        if ".".join(head) in table.MODULE_IMPORTS:
            return length, *table.MODULE_IMPORTS[".".join(head)]
        # a module the table maps whole (vllm.envs) is rewritten as the module, not name by name
        if length >= 2 and ".".join(head[:-1]) not in table.MODULE_IMPORTS and (
                ".".join(head[:-1]), head[-1]) in table.IMPORTS:
            return length, *table.IMPORTS[(".".join(head[:-1]), head[-1])]
    return None


def _uses(alias: ast.alias, uses: ModuleUses) -> tuple[str, list[_Use]]:
    # `import vllm.x.y` binds `vllm` (the package); `import vllm.x as y` binds y to vllm.x itself.
    local = alias.asname or alias.name.partition(".")[0]
    bound = alias.name.split(".") if alias.asname else [local]
    found = []
    for chain in uses.chains(local):
        attrs = [node.attr for node in chain[1:] if isinstance(node, ast.Attribute)]
        parts = bound + attrs
        match = _mapped(parts, len(bound))
        dotted = ".".join(parts)
        if match is None:
            if not attrs:
                dotted = f"{dotted} (the module used as a value, not through its attributes)"
            found.append(_Use(dotted, "", chain[-1], None, None))
        else:
            length, target_module, target_name = match
            found.append(_Use(dotted, ".".join(parts[:length]), chain[length - len(bound)], f"{target_module}.{target_name}",
                              target_module))
    return local, found


_ENVS = "vllm.envs"
Replace = Callable[..., None]  # (node, new text, uses=1): each use of a vLLM name it maps counts
Cannot = Callable[..., None]


def _port_uses(node: ast.Import, alias: ast.alias, uses: ModuleUses, replace: Replace, cannot: Cannot,
               imports: list[str]) -> tuple[int, int]:
    """Rewrite the mapped uses of `alias`'s local name, list the others; (uses mapped, uses in all).
    Our modules the rewritten uses need are added to `imports`."""
    local, alias_uses = _uses(alias, uses)
    if not alias_uses:
        cannot(node, f"import {alias.name}", "the-table-of-names",
               f"`{local}` is imported but not used as a module here: remove the import if it is not needed")
    num_mapped = 0
    for use in alias_uses:
        if use.replacement is None or use.target_module is None:
            cannot(use.node, use.dotted)
            continue
        replace(use.node, use.replacement)
        num_mapped += 1
        flag = use.dotted[len(use.source) + 1:].partition(".")[0] if use.source == _ENVS else ""
        if flag.startswith("VLLM_") and flag not in table.ENVS_ANSWERED:
            cannot(use.node, f"envs.{flag}", "environment-variables",
                   f"asyncengine has no counterpart of {flag}; plugins_api.envs answers {', '.join(table.ENVS_ANSWERED)}")
        if use.target_module not in imports:
            imports.append(use.target_module)
    return num_mapped, len(alias_uses)


def port_bare_import(node: ast.Import, uses: ModuleUses, statement_starts_line: bool, replace: Replace,
                     cannot: Cannot) -> None:
    """Rewrite the mapped uses of each `vllm` module `node` imports, and `node` itself to match."""
    kept: list[str] = []  # the aliases the statement keeps, as written
    imports: list[str] = []  # our modules the rewritten uses need
    changed = False
    for alias in node.names:
        written = alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
        if alias.name != "vllm" and not alias.name.startswith("vllm."):
            kept.append(written)
            continue
        local = alias.asname or alias.name.partition(".")[0]
        if local not in uses.ported:
            uses.ported[local] = _port_uses(node, alias, uses, replace, cannot, imports)
        num_mapped, num_uses = uses.ported[local]
        if num_mapped:
            changed = True
        if not num_mapped or num_mapped < num_uses:
            kept.append(written)  # still needed by the uses listed as unmapped
    if not changed:
        return
    block = id(uses.parent(node))
    if any(module.startswith("asyncengine.") for module in imports) and "asyncengine" in imports:
        imports.remove("asyncengine")  # `import asyncengine.plugins_api` binds `asyncengine` as well
    new_imports = [module for module in imports if (block, module) not in uses.imported]
    if not new_imports and len(kept) == len(node.names):
        return  # the statement stays as written (its name's uses were rewritten at another import of it)
    uses.imported.update((block, module) for module in imports)
    statements = ([f"import {', '.join(kept)}"] if kept else []) + [f"import {module}" for module in new_imports]
    if not statements:  # nothing left to import here: an empty line (the lines below keep their numbers)
        body = getattr(uses.parent(node), "body", None)
        statements = ["pass"] if isinstance(body, list) and body == [node] else [""]
    separator = "\n" + " " * node.col_offset if statement_starts_line else "; "
    replace(node, separator.join(statements), uses=0)  # the statement follows its uses, counted there
