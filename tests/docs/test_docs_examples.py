"""Every code example of the user guide (docs/*.md) and of README.md runs, and the count run equals the count present.

One test per page. For a page: its fences are checked (each names a language, none an alias that would
escape the run), its ```json and ```toml blocks are parsed, its file blocks (`<!-- file: path -->` before
the fence) are written into a fresh folder, then its python and bash blocks run there in page order, in
one fresh interpreter per page (doc_blocks.run_page). ASYNCENGINE_CACHE_DIR points at the session's model
cache, so the default model's GGUF file is converted once for the whole run.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from doc_blocks import COUNTS, REPO_ROOT, block_env, fence_problems, guide_pages, parse_blocks, run_page


@pytest.fixture(scope="session")
def docs_cache_root(default_model_dir: Path) -> Path:
    # tests/conftest.py converted the default model into a private cache; the examples share it.
    return default_model_dir.parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("page", guide_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_page_examples_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    blocks = parse_blocks(page)
    problems = fence_problems(blocks)
    assert not problems, "fences that break the docs conventions:\n" + "\n".join(problems)

    for b in blocks:
        if b.language == "json":
            try:
                json.loads(b.text)
            except json.JSONDecodeError as e:
                pytest.fail(f"{b.where}: the json block does not parse: {e}")
        elif b.language == "toml":
            try:
                tomllib.loads(b.text)
            except tomllib.TOMLDecodeError as e:
                pytest.fail(f"{b.where}: the toml block does not parse: {e}")

    examples = [b for b in blocks if b.runs]
    workdir = tmp_path / "reader"
    workdir.mkdir()
    env = block_env(request.getfixturevalue("docs_cache_root")) if examples else block_env()
    runs = run_page(page, workdir, env)
    files = [b for b in blocks if b.file is not None]
    assert all((workdir / b.file).is_file() for b in files)
    COUNTS[str(page.relative_to(REPO_ROOT))] = (len(examples), len(runs), len(files))
    assert [r.block.where for r in runs] == [b.where for b in examples], (
        f"{page.name}: {len(examples)} code examples present, {len(runs)} executed"
    )
