"""The rewrites of one file: Python by its syntax tree (exact positions, the rest of the text untouched),
pyproject.toml and setup.cfg by their entry-point group names.

Each function returns the new text, the rewrites made (line, old, new) and the uses it cannot map
(line, what, docs section, hint). Nothing here touches the file system.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from asyncengine.porting import table
from asyncengine.porting.bare_imports import ModuleUses, port_bare_import


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


@dataclass
class FileResult:
    text: str
    rewrites: list[Rewrite]
    unmapped: list[Unmapped]


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

    def replace(node: _Located, new: str) -> None:
        line, column, end_line, end_column = _span(node)
        start = offsets.index(line, column)
        end = offsets.index(end_line, end_column)
        edits.append((start, end, new, line))

    def cannot(node: _Located, what: str, section: str | None = None, hint: str | None = None) -> None:
        if section is None:
            section, hint = table.unmapped_reason(what)
        unmapped.append(Unmapped(node.lineno, what, section, hint or ""))

    uses: ModuleUses | None = None  # built at the first `import` statement
    in_fstring = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            _port_import_from(node, replace, cannot)
        elif isinstance(node, ast.Import):
            if uses is None:
                uses = ModuleUses(tree)
            starts_line = not text[offsets.index(node.lineno, 0):offsets.index(node.lineno, node.col_offset)].strip()
            _port_import(node, uses, starts_line, replace, cannot)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
            _port_string(node, offsets, text, replace, cannot)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs"
              and _VLLM_ENV.match(node.attr) and node.attr not in table.ENVS_ANSWERED):
            cannot(node, f"envs.{node.attr}", "environment-variables",
                   f"asyncengine has no counterpart of {node.attr}; plugins_api.envs answers "
                   f"{', '.join(table.ENVS_ANSWERED)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_model":
            if any(keyword.arg == "is_multimodal" for keyword in node.keywords):
                cannot(node, "register_model(..., is_multimodal=...)", "not-here-yet",
                       "multimodal models do not exist here yet")
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
    return FileResult(new_text, rewrites, sorted(unmapped, key=lambda u: u.line))


def _is_vllm_attention_forward(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """vLLM's AttentionImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, ...)."""
    names = [argument.arg for argument in node.args.args]
    return node.name == "forward" and names[1:3] == ["layer", "query"] and "attn_metadata" in names


def _port_import_from(node: ast.ImportFrom, replace, cannot) -> None:
    module = node.module or ""
    by_target: dict[str, list[str]] = {}
    kept: list[str] = []
    for alias in node.names:
        local = alias.asname or alias.name
        mapped = table.IMPORTS.get((module, alias.name))
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
    replace(node, ("\n" + indent).join(statements))


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


def _port_string(node: ast.Constant, offsets: _Offsets, text: str, replace, cannot) -> None:
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
    elif _VLLM_ENV.match(value) and value not in table.ENVIRONMENT_VARIABLES_READ:
        cannot(node, f"the environment variable {value}", "environment-variables",
               f"asyncengine reads {', '.join(table.ENVIRONMENT_VARIABLES.values())} only")
    elif _VLLM_REQUIREMENT.match(value):
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
    return FileResult("".join(lines), rewrites, unmapped)
