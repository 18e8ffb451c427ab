"""Duplicated code stays rare: pylint's duplicate-code check over asyncengine/ at 6 lines (issue 31, acceptance 5).

`make test` runs this file beside mypy (each takes one core for about as long), before the suite:

    python tests/duplicate_code.py            # exit 1 when more than ALLOWED places are found, listing them all
    python tests/duplicate_code.py PATH       # the same over another package folder

It is pylint's own duplicate-code engine (`Symilar`, what `pylint --enable=duplicate-code` runs) with pylint's
defaults for what does not count: imports, docstrings, comments and function signatures are ignored, so two
modules importing the same names, or two overrides with one signature, are not duplication. Each place it reports
is one run of at least MIN_LINES lines shared by two or more modules. It runs in this process, not as a pylint
subprocess: the same engine without pylint's per-module checker set-up, and nothing left running if it is stopped.
The file is not a `test_*.py` module, so pytest does not run it a second time; tests/test_duplicate_code_check.py
shows on a small package that it finds what it should.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "asyncengine"
MIN_LINES = 6
# Issue 31 allows at most six places; none of them may be repeated logic (a table of names or a shared argument
# list is tolerable, an algorithm written twice is not).
ALLOWED = 6
# Symilar's report opens each place with this line, then names each module and line range with "==".
_PLACE = re.compile(r"^\d+ similar lines in \d+ files$")


def duplicate_places(package: Path = PACKAGE, min_lines: int = MIN_LINES) -> list[str]:
    """Every place where modules under `package` share `min_lines` or more lines, as Symilar words each one."""
    from pylint.checkers.symilar import Symilar

    similar = Symilar(min_lines=min_lines, ignore_comments=True, ignore_docstrings=True, ignore_imports=True,
                      ignore_signatures=True)
    for path in sorted(package.rglob("*.py")):
        with path.open(encoding="utf-8") as stream:
            similar.append_stream(str(path.relative_to(package.parent)), stream)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        similar.run()
    places: list[list[str]] = []
    for line in report.getvalue().splitlines():
        if _PLACE.match(line):
            places.append([line])
        elif line.startswith("TOTAL lines="):
            break
        elif places and line.strip():
            places[-1].append(line)
    return ["\n".join(place) for place in places]


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else PACKAGE
    places = duplicate_places(package)
    if len(places) > ALLOWED:
        print("\n\n".join(places))
        print(f"\n{len(places)} places where modules under {package} share {MIN_LINES}+ lines (at most {ALLOWED}): "
              "move the shared code to one home and call it from both", file=sys.stderr)
        return 1
    print(f"duplicate code: {len(places)} places of {MIN_LINES}+ shared lines under {package} (at most {ALLOWED})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
