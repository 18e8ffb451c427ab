"""Runs the code examples of one page, in order, in the current directory (a fresh one per page).

Started by doc_blocks.run_page as `python page_runner.py RESULTS_DIR`. RESULTS_DIR/blocks.json lists the
page's examples ({"where", "language", "text"}). Python blocks share one namespace (as a reader typing them
into one session would); bash blocks run as `bash -euo pipefail -c`. Block i's stdout and stderr (its child
processes' too) go to RESULTS_DIR/i.out and i.err; once it has finished, its place is appended to
RESULTS_DIR/done.json, so the caller counts what really ran. The first failure stops the page (status 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path


def _redirect(out_path: Path, err_path: Path) -> tuple[int, int]:
    """Point fds 1 and 2 at the block's files (so child processes write there too); return the old ones."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    return saved


def _restore(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    os.close(saved[0])
    os.close(saved[1])


def main(results: Path) -> int:
    blocks = json.loads((results / "blocks.json").read_text())
    # The page's files are importable here (PYTHONPATH carries the folder for the engine's children).
    sys.path.insert(0, os.getcwd())
    namespace: dict = {"__name__": "__main__"}
    done: list[str] = []
    for index, block in enumerate(blocks):
        saved = _redirect(results / f"{index}.out", results / f"{index}.err")
        failed = False
        try:
            if block["language"] == "python":
                exec(compile(block["text"], block["where"], "exec"), namespace)
            else:
                status = subprocess.run(["bash", "-euo", "pipefail", "-c", block["text"]]).returncode
                if status != 0:
                    print(f"the bash block at {block['where']} exited with status {status}", file=sys.stderr)
                    failed = True
        except BaseException:  # noqa: BLE001 - any exception of an example fails it: reported, page stopped
            traceback.print_exc()
            failed = True
        finally:
            _restore(saved)
        if failed:
            return 1
        done.append(block["where"])
        (results / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
