"""Porting a plugin's source tree: which files are read, and the report of what changed and what cannot."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asyncengine.porting.codemod import FileResult, port_config_text, port_python

SKIPPED_DIRECTORIES = {".git", ".hg", ".venv", "venv", "build", "dist", "__pycache__", "node_modules", ".tox"}
CONFIG_FILES = ("pyproject.toml", "setup.cfg")
# An installed (or unpacked) wheel's registration: `*.dist-info/entry_points.txt`, in setup.cfg's INI form. An
# egg-info's copy is generated from the sources' pyproject.toml or setup.cfg, so it is not read.
WHEEL_ENTRY_POINTS = "entry_points.txt"
DOCS_PAGE = "docs/porting.md"


@dataclass
class PortReport:
    root: Path
    results: dict[Path, FileResult] = field(default_factory=dict)
    originals: dict[Path, str] = field(default_factory=dict)

    @property
    def changed(self) -> list[Path]:
        return [path for path, result in self.results.items() if result.text != self.originals[path]]

    def lines(self) -> list[str]:
        """One line per rewrite and per use that cannot be mapped, by file and line."""
        out = []
        for path, result in self.results.items():
            shown = path.relative_to(self.root) if path != self.root else path.name
            for rewrite in result.rewrites:
                out.append(f"{shown}:{rewrite.line}: rewrite: {rewrite.old}  ->  {rewrite.new}")
            for name in result.provided:
                out.append(f"{shown}:{name.line}: provided by name: {name.what}  ->  {name.ours} (no row of the "
                           "table: the import works; check that it behaves as vLLM's)")
            for use in result.unmapped:
                hint = f": {use.hint}" if use.hint else ""
                out.append(f"{shown}:{use.line}: cannot map {use.what}{hint} (see {DOCS_PAGE}#{use.section})")
        return out

    @property
    def num_mapped(self) -> int:
        """Uses of vLLM names the table maps."""
        return sum(result.mapped for result in self.results.values()) - self.num_provided

    @property
    def num_provided(self) -> int:
        """Uses of vLLM names the table has no row for, that ours of the same name provides."""
        return sum(len(result.provided) for result in self.results.values())

    @property
    def num_rewrites(self) -> int:
        return sum(len(result.rewrites) for result in self.results.values())

    @property
    def num_unmapped(self) -> int:
        return sum(len(result.unmapped) for result in self.results.values())

    def write(self) -> None:
        for path in self.changed:
            path.write_text(self.results[path].text, encoding="utf-8")


def port_tree(root: Path) -> PortReport:
    """Port every Python file, pyproject.toml and setup.cfg under `root` (or `root` itself, a file), in
    memory; `PortReport.write()` writes the changed ones."""
    root = root.resolve()
    report = PortReport(root)
    for path in _files(root):
        text = path.read_text(encoding="utf-8")
        report.originals[path] = text
        report.results[path] = port_python(text) if path.suffix == ".py" else port_config_text(text)
    return report


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).parts
        if any(part in SKIPPED_DIRECTORIES or part.endswith(".egg-info") for part in relative[:-1]):
            continue
        if path.is_file() and (path.suffix == ".py" or path.name in CONFIG_FILES or _is_wheel_registration(path)):
            found.append(path)
    return found


def _is_wheel_registration(path: Path) -> bool:
    return path.name == WHEEL_ENTRY_POINTS and path.parent.name.endswith(".dist-info")
