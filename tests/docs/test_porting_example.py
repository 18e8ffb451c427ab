"""The porting guide's example plugin (docs/porting.md), written against vLLM's API, runs on asyncengine
after exactly the renames the guide's table of names lists.

The renames are read from the page, so the test fails when the table and the plugin drift apart: an
import or entry-point group the table lacks is a failure, and so is a row whose asyncengine name does
not exist. The page's file blocks must be the files of tests/docs/porting_example/ (the copy kept in the
repository), and the page's short list of the changes must be what the renames changed. Unported, the
plugin does not import (vllm is absent) and asyncengine would not find its entry points; ported, it is
installed into a temporary target and runs in multiprocess mode: the capped request samples only ids
below the cap, a bad cap is refused with the plugin's ValueError, and both the out-of-tree op and the
logits processor ran in the worker rank 0 process (pid from the plugin's notes, role from the engine's
start-up report of the same run).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import DOCS_DIR, block_env, parse_blocks

PAGE = DOCS_DIR / "porting.md"
EXAMPLE = Path(__file__).resolve().parent / "porting_example" / "token-cap"
CAP = 1000

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import RequestError

prompt = "The three largest cities of France are"
plain = SamplingParams(temperature=0.0, max_tokens=12)
capped = SamplingParams(temperature=0.0, max_tokens=12, extra_args={"max_token_id": int(sys.argv[2])})
result = {"pid": os.getpid()}
# A small fixed KV cache: the engine skips measuring memory for it (start-up is what this test waits on).
with LLM(in_process=False, distributed_executor_backend="mp", startup_trace=sys.argv[1], max_model_len=512,
         kv_cache_memory_bytes=32 * 2**20) as llm:
    outputs = llm.generate([prompt, prompt], [plain, capped])
    result["plain"], result["capped"] = (list(output.outputs[0].token_ids) for output in outputs)
    try:
        llm.generate(prompt, SamplingParams(max_tokens=2, extra_args={"max_token_id": "x"}))
    except RequestError as error:
        result["refused"] = str(error)
print(json.dumps(result))
"""


def table_rows(page: Path, header: list[str]) -> list[list[str]]:
    """The rows of the page's table whose header is `header`, each cell with its backticks taken off."""
    lines = page.read_text(encoding="utf-8").splitlines()
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]  # noqa: E731
    for index, line in enumerate(lines):
        if line.startswith("|") and cells(line) == header:
            rows = []
            for row in lines[index + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell
                             for cell in cells(row)])
            return rows
    raise AssertionError(f"{page.name} has no table with the header {header}")


def names_table() -> dict[str, dict[str, str]]:
    """kind -> {vLLM name: asyncengine name}, from the page's table of names."""
    table: dict[str, dict[str, str]] = {}
    for kind, vllm_name, our_name, _reference in table_rows(PAGE, ["kind", "vLLM", "asyncengine", "reference"]):
        table.setdefault(kind, {})[vllm_name] = our_name
    return table


def port(source: Path, target: Path, table: dict[str, dict[str, str]]) -> set[tuple[str, str, str]]:
    """Copy the plugin, apply the table's renames; returns (file name, old, new) for each change."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    changes = set()
    groups = table["entry-point group"]
    pyproject = target / "pyproject.toml"

    def rename_group(match: re.Match) -> str:
        group = match.group(1)
        if group.startswith("vllm."):
            assert group in groups, f"the table of names has no row for the entry-point group {group}"
            changes.add(("pyproject.toml", group, groups[group]))
            return f'[project.entry-points."{groups[group]}"]'
        return match.group(0)

    pyproject.write_text(re.sub(r'^\[project\.entry-points\."([^"]+)"\]$', rename_group, pyproject.read_text(),
                                flags=re.M))

    imports = table["import"]
    for module_file in sorted(target.rglob("*.py")):
        lines = module_file.read_text().splitlines(keepends=True)
        for number, line in enumerate(lines):
            found = re.match(r"^(\s*)from (vllm(?:\.\w+)*) import ([\w, ]+)$", line.rstrip("\n"))
            if not found:
                assert not re.match(r"^\s*(import vllm|from vllm)", line), (
                    f"{module_file.name}: an import of vllm the renames cannot read: {line!r}")
                continue
            indent, module, names = found.groups()
            by_module: dict[str, list[str]] = {}
            for name in (name.strip() for name in names.split(",")):
                qualified = f"{module}.{name}"
                assert qualified in imports, f"the table of names has no row for {qualified} ({module_file.name})"
                new_module, new_name = imports[qualified].rsplit(".", 1)
                by_module.setdefault(new_module, []).append(new_name)
            new = "".join(f"{indent}from {m} import {', '.join(n)}\n" for m, n in by_module.items())
            changes.add((module_file.name, line.strip(), new.strip()))
            lines[number] = new
        module_file.write_text("".join(lines))
    return changes


def install(source: Path, target: Path) -> Path:
    # From a copy: pip builds in the source folder, and the repository's copy must stay clean.
    build = target.with_name(target.name + "-src")
    shutil.copytree(source, build, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(build)], check=True, capture_output=True, text=True)
    return target


def installed_plugins(target: Path, env: dict[str, str]) -> str:
    """What `asyncengine plugins list` finds with `target` on the path."""
    listed = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "list"],
                            capture_output=True, text=True, env={**env, "PYTHONPATH": str(target)}, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return listed.stdout


def test_the_table_names_only_what_asyncengine_has() -> None:
    from asyncengine.plugin_runtime.groups import BY_ENTRY_POINT_GROUP

    table = names_table()
    for vllm_group, our_group in table["entry-point group"].items():
        assert vllm_group.startswith("vllm.") and our_group in BY_ENTRY_POINT_GROUP, (vllm_group, our_group)
    for vllm_name, our_name in table["import"].items():
        assert vllm_name.startswith("vllm."), vllm_name
        module, name = our_name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), f"{our_name} (for {vllm_name}) does not exist"
    assert table["environment variable"] == {"VLLM_PLUGINS": "ASYNCENGINE_PLUGINS"}


def test_the_page_shows_the_example_as_it_is_in_the_repository() -> None:
    shown = {block.file: block.text for block in parse_blocks(PAGE) if block.file is not None}
    kept = {f"token-cap/{path.relative_to(EXAMPLE)}": path.read_text() for path in EXAMPLE.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}
    assert shown == kept


@pytest.mark.slow
@pytest.mark.extension_point("E1", "E6", "R2")
def test_the_vllm_plugin_runs_here_after_the_renames(tmp_path: Path, default_model_dir: Path) -> None:
    env = block_env(default_model_dir.parent.parent, TOKEN_CAP_RECORD=str(tmp_path / "record.jsonl"))

    # Unported, it does not import: it is written against vllm, which is not installed.
    assert importlib.util.find_spec("vllm") is None
    for module in ("token_cap.ops", "token_cap.processor"):
        unported = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                                  env={**env, "PYTHONPATH": str(EXAMPLE / "src"), "PYTHONDONTWRITEBYTECODE": "1"})
        assert unported.returncode != 0 and "No module named 'vllm'" in unported.stderr, unported.stderr

    # Installed unported, asyncengine does not even find it: its entry points are in vLLM's groups.
    assert "token_cap" not in installed_plugins(install(EXAMPLE, tmp_path / "unported"), env)

    # Ported with the page's table; the page's list of changes is what the renames changed.
    changes = port(EXAMPLE, tmp_path / "token-cap", names_table())
    listed = {(where.strip("`").rsplit("/", 1)[-1], old, new)
              for where, old, new in table_rows(PAGE, ["in", "vLLM", "asyncengine"])}
    assert changes == listed

    target = install(tmp_path / "token-cap", tmp_path / "target")
    found = installed_plugins(target, env)
    assert re.search(r"asyncengine\.general_plugins\s+token_cap_ops\s+\[token-cap 0\.1\.0\]\s+allowed", found), found
    assert re.search(r"asyncengine\.logits_processors\s+token_cap\s+\[token-cap 0\.1\.0\]\s+allowed", found), found
    script = tmp_path / "use_token_cap.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, str(script), str(trace), str(CAP)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(target)}, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])

    assert result["capped"] and all(token < CAP for token in result["capped"]), result
    assert any(token >= CAP for token in result["plain"]), result  # the cap changed something
    assert "token_cap.processor:TokenCapProcessor" in result["refused"], result
    assert "ValueError: max_token_id must be a positive integer, got 'x'" in result["refused"], result

    # Where each part ran: pid from the plugin's notes, role from the start-up report of the same run.
    roles = {record["pid"]: record["role"] for record in json.loads(trace.read_text())}
    notes = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert sorted(note["what"] for note in notes) == ["logits processor apply", "silu_and_mul"], notes
    for note in notes:
        assert roles.get(note["pid"]) == "worker rank 0" and note["pid"] != result["pid"], (note, roles)
