"""Every row of the reference (docs/reference.md: the extension points E1-E6, R1-R15, C1-C9, the Platform
interface P, the cross-process manifest X, and the five "what goes wrong in vLLM" lines G1-G5) is proven
by at least one end-to-end test in tests/e2e/, which names it with `@pytest.mark.extension_point(...)`.

Read from the test sources (not from a collected session), so it holds whichever tests a run selects.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = (
    [f"E{n}" for n in range(1, 7)] + [f"R{n}" for n in range(1, 16)] + [f"C{n}" for n in range(1, 10)]
    + ["P", "X"] + [f"G{n}" for n in range(1, 6)]
)


def marked_tests(folder: Path) -> dict[str, list[str]]:
    """Row id -> the tests ("file::function") marked with it, in the test files under `folder`."""
    rows: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test"):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                        and decorator.func.attr == "extension_point"):
                    for arg in decorator.args:
                        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                            raise AssertionError(f"{path}:{node.lineno}: extension_point takes row ids as strings")
                        rows.setdefault(arg.value, []).append(f"{path.relative_to(ROOT)}::{node.name}")
    return rows


def test_every_row_has_an_end_to_end_test():
    rows = marked_tests(ROOT / "tests" / "e2e")
    missing = [row for row in ROWS if row not in rows]
    assert not missing, f"rows with no test marked extension_point(...) in tests/e2e: {missing}"


def test_marks_name_only_known_rows():
    everywhere = marked_tests(ROOT / "tests")
    for folder in sorted((ROOT / "plugins").glob("*/tests")):
        for row, tests in marked_tests(folder).items():
            everywhere.setdefault(row, []).extend(tests)
    unknown = {row: tests for row, tests in everywhere.items() if row not in ROWS}
    assert not unknown, f"extension_point marks naming no row of the reference: {unknown}"


def test_the_reference_page_has_an_anchor_for_every_row():
    page = (ROOT / "docs" / "reference.md").read_text()
    anchors = set(re.findall(r'<a id="([a-z0-9]+)"></a>', page))
    assert anchors >= {row.lower() for row in ROWS}, sorted({row.lower() for row in ROWS} - anchors)
