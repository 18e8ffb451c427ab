"""The rewrites of one file: Python by its syntax tree (exact positions, the rest of the text untouched),
pyproject.toml and setup.cfg by their entry-point group names.

Each function returns the new text, the rewrites made (line, old, new) and the uses it cannot map
(line, what, docs section, hint). Nothing here touches the file system.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from asyncengine.porting import table
from asyncengine.porting.bare_imports import ModuleUses, port_bare_import
from asyncengine.porting.vllm_env_names import VLLM_ENVIRONMENT_VARIABLES


@dataclass(frozen=True)
class Rewrite:
    line: int
    old: str
    new: str


@dataclass(frozen=True)
class Unmapped:
    line: int
    what: str
    section: str
    hint: str


@dataclass(frozen=True)
class Provided:
    """A vLLM name the table has no row for, rewritten to ours of the same name: the import works; whether it
    behaves as vLLM's is for the plugin's own tests to show."""

    line: int
    what: str
    ours: str


@dataclass
class FileResult:
    text: str
    rewrites: list[Rewrite]
    unmapped: list[Unmapped]
    mapped: int = 0  # uses of vLLM names the table maps (an import of three names is three uses)
    provided: list[Provided] = field(default_factory=list)


_VLLM_DOTTED = re.compile(r"^vllm(\.[A-Za-z_]\w*)+$")
_VLLM_ENV = re.compile(r"^VLLM_[A-Z0-9_]+$")
_VLLM_REQUIREMENT = re.compile(r"^vllm(\s*[<>=!~\[;].*)?$")


class _Offsets:
    """(line, UTF-8 column) as ast gives them -> index in the text."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def index(self, line: int, column: int) -> int:
        encoded = self.lines[line - 1].encode("utf-8") if line - 1 < len(self.lines) else b""
        return self.starts[line - 1] + len(encoded[:column].decode("utf-8", errors="replace"))


# The parsed nodes that carry a position in the text.
_Located = ast.expr | ast.stmt | ast.alias


def _span(node: _Located) -> tuple[int, int, int, int]:
    """(line, column, end line, end column) of a node; ast.parse sets all four, a node built by hand may not."""
    if node.end_lineno is None or node.end_col_offset is None:
        raise ValueError(f"{type(node).__name__} at line {node.lineno} has no end position (not from ast.parse)")
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def port_python(text: str) -> FileResult:
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return FileResult(text, [], [Unmapped(exc.lineno or 1, f"a syntax error: {exc.msg}", "the-port-tool",
                                              "fix the file so that Python can parse it, then port again")])
    offsets = _Offsets(text)
    edits: list[tuple[int, int, str, int]] = []  # (start, end, new text, line)
    unmapped: list[Unmapped] = []
    provided: list[Provided] = []
    counted = [0]  # uses mapped

    def replace(node: _Located, new: str, uses: int = 1) -> None:
        line, column, end_line, end_column = _span(node)
        start = offsets.index(line, column)
        end = offsets.index(end_line, end_column)
        edits.append((start, end, new, line))
        counted[0] += uses

    def provide(node: _Located, what: str, ours: str) -> None:
        provided.append(Provided(node.lineno, what, ours))

    def cannot(node: _Located, what: str, section: str | None = None, hint: str | None = None) -> None:
        if section is None:
            section, hint = table.unmapped_reason(what)
        unmapped.append(Unmapped(node.lineno, what, section, hint or ""))

    uses: ModuleUses | None = None  # built at the first `import` statement
    in_fstring = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    requirements = _requirement_strings(tree)
    envs_names = _names_bound_to_vllm_envs(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            _port_import_from(node, replace, cannot, provide)
        elif isinstance(node, ast.Import):
            if uses is None:
                uses = ModuleUses(tree)
            starts_line = not text[offsets.index(node.lineno, 0):offsets.index(node.lineno, node.col_offset)].strip()
            _port_import(node, uses, starts_line, replace, cannot)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
            _port_string(node, offsets, text, replace, cannot, is_requirement=id(node) in requirements)
        elif _is_vllm_logger_call(node):
            # logging.getLogger("vllm"): the handlers a plugin attaches there belong on ours
            replace(node.args[0], '"asyncengine"')  # type: ignore[attr-defined]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in envs_names
              and _VLLM_ENV.match(node.attr) and node.attr not in table.ENVS_ANSWERED):
            cannot(node, f"envs.{node.attr}", "environment-variables",
                   f"asyncengine has no counterpart of {node.attr}; plugins_api.envs answers "
                   f"{', '.join(table.ENVS_ANSWERED)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_vllm_attention_forward(node):
            cannot(node, "forward(layer, query, key, value, kv_cache, attn_metadata, ...) (vLLM's AttentionImpl)",
                   "attention-backends", "the implementation's forward here is forward(query, key, value, kv_cache, "
                   "metadata): kv_cache is (key_cache, value_cache), each [num_kv_heads, num_blocks, block_size, "
                   "head_dim], and metadata our AttentionMetadata; rewrite its kernel call for them")

    new_text, rewrites = text, []
    for start, end, new, line in sorted(edits, reverse=True):
        rewrites.append(Rewrite(line, text[start:end], new))
        new_text = new_text[:start] + new + new_text[end:]
    rewrites.reverse()
    return FileResult(new_text, rewrites, sorted(unmapped, key=lambda u: u.line), counted[0],
                      sorted(provided, key=lambda p: p.line))


_REQUIREMENT_KEYWORDS = {"install_requires", "setup_requires", "requires", "extras_require", "dependencies",
                         "tests_require"}


def _requirement_strings(tree: ast.AST) -> set[int]:
    """The string constants that are requirements: inside setup()'s requirement keywords, or a list assigned to
    a name that says so (`requirements = [...]`). Elsewhere "vllm" is a logger's or a module's name."""
    found: set[int] = set()
    holders: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in _REQUIREMENT_KEYWORDS:
            holders.append(node.value)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and "require" in t.id.lower()
                                                  for t in node.targets):
            holders.append(node.value)
    for holder in holders:
        found.update(id(n) for n in ast.walk(holder) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return found


def _names_bound_to_vllm_envs(tree: ast.AST) -> set[str]:
    """Local names this file binds to vLLM's envs module (`import vllm.envs as e`, `from vllm import envs`):
    their `VLLM_*` attributes are vLLM's flags. A plugin's own envs module's flags are no concern of the tool."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname for alias in node.names if alias.name == "vllm.envs" and alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "vllm" and node.level == 0:
            names.update(alias.asname or alias.name for alias in node.names if alias.name == "envs")
    return names


def _is_vllm_logger_call(node: ast.AST) -> bool:
    """`logging.getLogger("vllm")` (or `getLogger("vllm")`): vLLM's root logger, which is asyncengine's here."""
    if not isinstance(node, ast.Call) or len(node.args) != 1 or node.keywords:
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    argument = node.args[0]
    return name == "getLogger" and isinstance(argument, ast.Constant) and argument.value == "vllm"


def _is_vllm_attention_forward(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """vLLM's AttentionImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, ...)."""
    names = [argument.arg for argument in node.args.args]
    return node.name == "forward" and names[1:3] == ["layer", "query"] and "attn_metadata" in names


def _port_import_from(node: ast.ImportFrom, replace, cannot, provide) -> None:
    module = node.module or ""
    by_target: dict[str, list[str]] = {}
    kept: list[str] = []
    for alias in node.names:
        local = alias.asname or alias.name
        mapped = table.IMPORTS.get((module, alias.name))
        if mapped is None and alias.name != "*" and (ours := table.provided_by_name(alias.name)) is not None:
            mapped = (ours, alias.name)
            provide(node, f"{module}.{alias.name}", f"{ours}.{alias.name}")
        if mapped is None:
            kept.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
            cannot(node, f"{module}.{alias.name}" if alias.name != "*" else f"from {module} import *")
            continue
        target_module, target_name = mapped
        by_target.setdefault(target_module, []).append(
            target_name if target_name == local else f"{target_name} as {local}")
    if not by_target:
        return
    indent = " " * node.col_offset
    statements = [f"from {target} import {', '.join(names)}" for target, names in by_target.items()]
    if kept:  # left as it was, and listed as unmapped: the plugin still needs it changed by hand
        statements.append(f"from {module} import {', '.join(kept)}")
    replace(node, ("\n" + indent).join(statements), uses=len(node.names) - len(kept))


def _port_import(node: ast.Import, uses: ModuleUses, statement_starts_line: bool, replace, cannot) -> None:
    vllm_aliases = [alias for alias in node.names if _is_vllm(alias.name)]
    if not vllm_aliases:
        return
    if len(node.names) == 1 and vllm_aliases[0].name in table.MODULE_IMPORTS and vllm_aliases[0].asname:
        alias = vllm_aliases[0]
        target_module, target_name = table.MODULE_IMPORTS[alias.name]
        local = alias.asname
        replace(node, f"from {target_module} import {target_name if target_name == local else f'{target_name} as {local}'}")
        return
    port_bare_import(node, uses, statement_starts_line, replace, cannot)


def _port_string(node: ast.Constant, offsets: _Offsets, text: str, replace, cannot, *,
                 is_requirement: bool = False) -> None:
    value = node.value
    if not isinstance(value, str):  # port_python passes string constants only
        return
    new = (table.ENTRY_POINT_GROUPS.get(value) or table.ENVIRONMENT_VARIABLES.get(value)
           or table.CLASS_PATHS.get(value) or table.ATTRIBUTE_PATHS.get(value))
    if new is not None:
        line, column, end_line, end_column = _span(node)
        start = offsets.index(line, column)
        end = offsets.index(end_line, end_column)
        literal = text[start:end]
        if value in literal:  # not spelled with escapes: keep the quotes and any prefix as written
            replace(node, literal.replace(value, new, 1))
            return
        cannot(node, f"the string {value!r}", "the-table-of-names", f"write it as {new!r}")
    elif _VLLM_DOTTED.match(value):
        section, hint = table.unmapped_reason(value)
        cannot(node, f"the class path {value!r}", section, hint)
    elif (_VLLM_ENV.match(value) and value in VLLM_ENVIRONMENT_VARIABLES
          and value not in table.ENVIRONMENT_VARIABLES_READ and value not in table.ENVS_ANSWERED):
        cannot(node, f"the environment variable {value}", "environment-variables",
               f"asyncengine reads {', '.join(table.ENVIRONMENT_VARIABLES.values())} only")
    elif is_requirement and _VLLM_REQUIREMENT.match(value):
        cannot(node, f"the requirement {value!r}", "dependencies", "depend on asyncengine instead of vllm")


_GROUP_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(g) for g in table.ENTRY_POINT_GROUPS) + r")(?![\w.])")
_ENV_PATTERN = re.compile(r"\b(" + "|".join(table.ENVIRONMENT_VARIABLES) + r")\b")
_REQUIREMENT_PATTERN = re.compile(r"""["']vllm(\s*[<>=!~\[;][^"']*)?["']""")


def port_config_text(text: str) -> FileResult:
    """pyproject.toml or setup.cfg: the entry-point groups and environment variable names, line by line."""
    rewrites, unmapped, lines = [], [], []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        new = _GROUP_PATTERN.sub(lambda m: table.ENTRY_POINT_GROUPS[m.group(1)], line)
        new = _ENV_PATTERN.sub(lambda m: table.ENVIRONMENT_VARIABLES[m.group(1)], new)
        if new != line:
            rewrites.append(Rewrite(number, line.strip(), new.strip()))
        requirement = _REQUIREMENT_PATTERN.search(new)
        if requirement:
            unmapped.append(Unmapped(number, f"the requirement {requirement.group(0)}", "dependencies",
                                     "depend on asyncengine instead of vllm"))
        lines.append(new)
    return FileResult("".join(lines), rewrites, unmapped, len(rewrites))
