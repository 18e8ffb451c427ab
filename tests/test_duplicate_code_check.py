"""tests/duplicate_code.py (run by `make test` beside mypy) finds a function written twice and nothing else."""

from __future__ import annotations

from pathlib import Path

from duplicate_code import duplicate_places

BODY = '''
def weighted_mean(values, weights):
    total = 0.0
    weight_sum = 0.0
    for value, weight in zip(values, weights):
        total += value * weight
        weight_sum += weight
    if weight_sum == 0:
        raise ValueError("weights sum to zero")
    return total / weight_sum
'''


def test_a_function_written_twice_is_one_place(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("import math\n" + BODY)
    (package / "second.py").write_text("import os\n" + BODY.replace("weighted_mean", "mean_by_weight"))
    (package / "third.py").write_text("def unrelated(x):\n    return x + 1\n")
    places = duplicate_places(package)
    assert len(places) == 1, places
    assert "pkg/first.py" in places[0] and "pkg/second.py" in places[0]
    assert "pkg/third.py" not in places[0]


def test_imports_and_short_runs_do_not_count(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    imports = "".join(f"import module_{i}\n" for i in range(10))
    (package / "a.py").write_text(imports + "x = 1\ny = 2\n")
    (package / "b.py").write_text(imports + "x = 1\ny = 2\n")
    assert duplicate_places(package) == []
