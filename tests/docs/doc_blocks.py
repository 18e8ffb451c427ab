"""The code blocks of a docs page, and running them the way a reader would: in order, in an empty folder.

Conventions (docs pages follow them; docs/contributing.md says the same for writers):
- every fence names its language;
- ```python and ```bash blocks are code examples, executed in page order with the working directory a
  fresh temporary folder: the python blocks of a page in one fresh interpreter (sharing one namespace, as
  a reader typing them into one session), bash blocks with `bash -euo pipefail`;
- a block preceded (on the line just before its fence) by `<!-- file: relative/path -->` is written to
  that path (all of a page's files before its first example runs) instead of being executed; later
  blocks use it, and the folder is on PYTHONPATH, so the engine's child processes import it too;
- ```text blocks are output samples or synopses; ```json and ```toml blocks are parsed; other formats
  (yaml, ini, html, ...) are shown as they are. Aliases of the executed languages (sh, shell, console,
  py, pycon, ...) are refused, so that nothing looks like an example while escaping the run.

Shared by the docs tests (tests/docs/): one parser and one runner, so every test reads a page the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_DIR = REPO_ROOT / "docs"
RUNNER = Path(__file__).with_name("page_runner.py")
EXECUTED_LANGUAGES = ("python", "bash")
# Formats shown as they are (data or output, not a program).
SHOWN_LANGUAGES = ("text", "toml", "json", "yaml", "ini", "html", "javascript", "css", "diff", "http")
# Aliases refused, with what to write instead.
REFUSED_LANGUAGES = {
    "py": "python", "python3": "python", "pycon": "python (without >>> prompts)", "ipython": "python",
    "sh": "bash", "shell": "bash", "zsh": "bash", "console": "bash (without $ prompts), or text for output",
    "shell-session": "bash, or text for output", "js": "javascript", "yml": "yaml",
}

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_FILE_COMMENT = re.compile(r"^\s*<!--\s*file:\s*(?P<path>\S+)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    language: str  # the first word of the fence's info string ("" when none)
    text: str
    line: int  # 1-based line of the opening fence, for messages
    file: str | None  # the path of a `<!-- file: ... -->` block, relative to the working folder
    page: str = ""  # the page, relative to the repository root

    @property
    def runs(self) -> bool:
        return self.file is None and self.language in EXECUTED_LANGUAGES

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


class PageError(ValueError):
    """A page breaks the conventions above (named with its path and line)."""


def guide_pages() -> list[Path]:
    """Every page of the guide, and the repository's README (its examples are code examples too)."""
    return sorted(DOCS_DIR.glob("*.md")) + [REPO_ROOT / "README.md"]


def _relative(page: Path) -> str:
    try:
        return str(page.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(page)


def parse_blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order (fences indented in list items too). An unclosed fence or an
    unsafe file path is a PageError."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = _relative(page)
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = lines[index].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                break
            body.append(lines[index])
            index += 1
        else:
            raise PageError(f"{name}:{start + 1}: the code block opened here is never closed")
        index += 1
        file_comment = _FILE_COMMENT.match(lines[start - 1]) if start > 0 else None
        path = file_comment["path"] if file_comment else None
        if path is not None and (Path(path).is_absolute() or ".." in Path(path).parts):
            raise PageError(f"{name}:{start}: file path {path!r} must be relative and stay inside the folder")
        language = info.split()[0].lower() if info else ""
        indent = len(opening["indent"])
        # A fence indented in a list item indents its body as much; take that off.
        text = "\n".join(line[min(indent, len(line) - len(line.lstrip(" "))):] for line in body)
        blocks.append(Block(language=language, text=text + "\n", line=start + 1, file=path, page=name))
    return blocks


def fence_problems(blocks: list[Block]) -> list[str]:
    """The fences that break the conventions, each with its place and what to write instead."""
    problems = []
    for b in blocks:
        if not b.language:
            problems.append(f"{b.where}: fence without a language; write ```python or ```bash (executed), "
                            f"```text for output, or the format (toml, json, ...)")
        elif b.language in REFUSED_LANGUAGES:
            problems.append(f"{b.where}: ```{b.language} is refused by the docs conventions; "
                            f"write ```{REFUSED_LANGUAGES[b.language]}")
        elif b.language not in EXECUTED_LANGUAGES + SHOWN_LANGUAGES:
            problems.append(f"{b.where}: unknown fence language {b.language!r}; known: "
                            f"{', '.join(EXECUTED_LANGUAGES + SHOWN_LANGUAGES)}")
    return problems


def venv_python() -> str:
    """The repository's interpreter (.venv), the one a reader of the guide runs."""
    venv = REPO_ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def block_env(cache_dir: Path | str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a page's blocks: the repository's interpreter and scripts first on PATH (so
    `python` and `asyncengine` are the ones under test), no inherited PYTHONPATH or allow-list."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCENGINE_PLUGINS")}
    env["PATH"] = os.pathsep.join([str(Path(venv_python()).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    if cache_dir is not None:
        env["ASYNCENGINE_CACHE_DIR"] = str(cache_dir)
    env.update(extra)
    return env


@dataclass(frozen=True)
class BlockRun:
    block: Block
    stdout: str
    stderr: str


def write_files(blocks: list[Block], workdir: Path) -> int:
    """Write the page's file blocks into `workdir`; returns how many."""
    written = 0
    for block in blocks:
        if block.file is not None:
            target = workdir / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            written += 1
    return written


def run_page(page: Path, workdir: Path, env: dict[str, str], *, timeout: float = 300) -> list[BlockRun]:
    """Write the file blocks of `page`, then execute its examples in order in `workdir`.

    One fresh interpreter per page (page_runner.py) runs the python blocks in one namespace and each bash
    block as `bash -euo pipefail -c`; `workdir` is put first on PYTHONPATH. A block that fails (or a page
    past `timeout` seconds) raises AssertionError naming the page, the line and the output so far.
    Returns one BlockRun per executed block, in page order."""
    blocks = parse_blocks(page)
    write_files(blocks, workdir)
    examples = [b for b in blocks if b.runs]
    if not examples:
        return []
    results = workdir.parent / f"{workdir.name}.doc-run"
    results.mkdir(exist_ok=True)
    (results / "blocks.json").write_text(
        json.dumps([{"where": b.where, "language": b.language, "text": b.text} for b in examples]))
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(workdir), env.get("PYTHONPATH", "")) if p)

    def outputs(index: int) -> tuple[str, str]:
        out, err = results / f"{index}.out", results / f"{index}.err"
        return (out.read_text(errors="replace") if out.exists() else "",
                err.read_text(errors="replace") if err.exists() else "")

    def done() -> list[str]:
        path = results / "done.json"
        return json.loads(path.read_text()) if path.exists() else []

    try:
        proc = subprocess.run([venv_python(), str(RUNNER), str(results)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=timeout)
        failure = None if proc.returncode == 0 else f"exited with status {proc.returncode}"
        runner_output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        failure, runner_output = f"ran past {timeout} s", ""
    ran = done()
    if failure is not None:
        index = len(ran)
        stdout, stderr = outputs(index)
        where = examples[index].where if index < len(examples) else page.name
        raise AssertionError(
            f"{where}: the {examples[index].language if index < len(examples) else ''} block {failure} "
            f"({len(ran)} of {len(examples)} examples of the page had run)\n--- block ---\n"
            f"{examples[index].text if index < len(examples) else ''}--- stdout ---\n{stdout[-6000:]}"
            f"--- stderr ---\n{stderr[-6000:]}--- runner ---\n{runner_output[-2000:]}"
        )
    return [BlockRun(block=b, stdout=outputs(i)[0], stderr=outputs(i)[1]) for i, b in enumerate(examples)
            if b.where in ran]


# page -> (examples present, examples executed, file blocks written), filled by test_docs_examples.py and
# printed at the end of the run by tests/docs/conftest.py.
COUNTS: dict[str, tuple[int, int, int]] = {}


def summary_lines() -> list[str]:
    if not COUNTS:
        return []
    present = sum(c[0] for c in COUNTS.values())
    executed = sum(c[1] for c in COUNTS.values())
    lines = [f"docs examples: {executed} executed of {present} present (python + bash), "
             f"{sum(c[2] for c in COUNTS.values())} file blocks written, {len(COUNTS)} pages"]
    lines += [f"  {page}: {c[1]}/{c[0]} executed, {c[2]} files written" for page, c in sorted(COUNTS.items())]
    return lines
