"""docs/tour-toy-plugin.md, run as a reader would, from an empty folder, gives a working plugin.

The page's blocks run in order (doc_blocks.run_page: its files written, then its bash and python blocks),
in multiprocess mode as the page says. Checked afterwards, from what the run left behind and printed:
the distribution was installed into the folder's target with its entry point, `plugins list` sees it,
and the plugin does what the page promises: greedy output with `no_repeat` has no repeated token while
the plain one has, a bad argument is refused in the script's (frontend's) process, and `apply` ran in
the worker rank 0, a process other than the script's. The page's `text` samples are checked against
the real output, so they cannot drift from what the code prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from doc_blocks import DOCS_DIR, block_env, parse_blocks, run_page

PAGE = DOCS_DIR / "tour-toy-plugin.md"


@pytest.fixture(scope="session")
def docs_cache_root(default_model_dir: Path) -> Path:
    # The default model converted once per session (tests/conftest.py); the examples share its cache.
    return default_model_dir.parent.parent


def normalized(text: str) -> list[str]:
    """The lines of an output, with process ids replaced (they differ from run to run)."""
    return [re.sub(r"pid \d+", "pid N", line.rstrip()) for line in text.strip().splitlines()]


def samples_after_examples(page: Path) -> dict[str, str]:
    """For each executed block immediately followed by a ```text block: the block's place -> the sample."""
    blocks = parse_blocks(page)
    return {block.where: following.text for block, following in zip(blocks, blocks[1:])
            if block.runs and following.language == "text" and following.file is None}


@pytest.mark.slow
@pytest.mark.extension_point("E6")
def test_the_tour_from_an_empty_folder_gives_a_working_plugin(tmp_path: Path, docs_cache_root: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    runs = run_page(PAGE, folder, block_env(docs_cache_root))
    examples = [block for block in parse_blocks(PAGE) if block.runs]
    assert [run.block.where for run in runs] == [block.where for block in examples]

    # Installed as a real distribution, into the folder's target, with its entry point.
    entry_points = (folder / "plugins" / "toy_no_repeat-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[asyncengine.logits_processors]" in entry_points
    assert "toy_no_repeat = toy_no_repeat:NoRepeatProcessor" in entry_points

    by_command = {run.block.text.strip(): run for run in runs}
    listed = by_command["PYTHONPATH=$PWD/plugins asyncengine plugins list"].stdout
    assert re.search(r"asyncengine\.logits_processors\s+toy_no_repeat\s+\[toy-no-repeat 0\.1\.0\]\s+allowed\s+"
                     r"loaded in: frontend, worker", listed), listed
    skipped = by_command["PYTHONPATH=$PWD/plugins ASYNCENGINE_PLUGINS= asyncengine plugins list"].stdout
    assert "toy_no_repeat" in skipped and "skipped: not allowed (ASYNCENGINE_PLUGINS does not name it)" in skipped

    # The effect, from the script's own output.
    script = by_command["PYTHONPATH=$PWD/plugins python use_it.py"]
    script_pid = int(re.search(r"^script: pid (\d+)$", script.stdout, re.M).group(1))
    counts = {name: (int(total), int(distinct), text) for name, total, distinct, text in
              re.findall(r"^(plain|no_repeat): (\d+) tokens, (\d+) distinct: (.*)$", script.stdout, re.M)}
    assert set(counts) == {"plain", "no_repeat"}, script.stdout
    plain_total, plain_distinct, plain_text = counts["plain"]
    total, distinct, text = counts["no_repeat"]
    assert total == distinct > 0  # no token twice
    assert plain_distinct < plain_total  # the plain completion does repeat: the processor changed something
    assert text != plain_text
    assert "refused: no_repeat must be true or false, got 'yes'" in script.stdout

    # Where apply ran: the worker rank 0, a process of its own (multiprocess mode).
    where = re.findall(r"^toy_no_repeat: apply runs in the (.+) process \(pid (\d+)\)$", script.stderr, re.M)
    assert len(where) == 1, script.stderr
    role, pid = where[0]
    assert role == "worker rank 0" and int(pid) != script_pid

    # The page's samples are what the blocks print (process ids aside).
    samples = samples_after_examples(PAGE)
    assert samples, "the page shows no output sample"
    for run in runs:
        if run.block.where in samples:
            printed = normalized(run.stdout + "\n" + run.stderr)
            shown = normalized(samples[run.block.where])
            missing = [line for line in shown if line not in printed]
            assert not missing, f"{run.block.where}: the sample shows lines the run did not print: {missing}"
            unshown = [line for line in normalized(run.stdout) if line not in shown]
            assert not unshown, f"{run.block.where}: the run printed lines the sample lacks: {unshown}"
