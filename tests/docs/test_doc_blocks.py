"""The docs tests' parser and runner (doc_blocks.py) on small pages written here: what they find, refuse and run."""

from __future__ import annotations

from pathlib import Path

import pytest

from doc_blocks import block_env, fence_problems, parse_blocks, run_page

PAGE = '''# A page

```python
x = 2
```

- a list item with an indented example:

  ```bash
  echo "from bash: $(cat note.txt)"
  ```

<!-- file: note.txt -->
```text
written, not run
```

<!-- file: helper.py -->
```python
VALUE = 40
```

```text
an output sample
```

````text
```python
not a block of its own
```
````

```python
import helper
print(helper.VALUE + x)
```
'''


def test_blocks_are_found_in_order_with_their_kind(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    blocks = parse_blocks(page)
    assert [(b.language, b.file, b.runs) for b in blocks] == [
        ("python", None, True), ("bash", None, True), ("text", "note.txt", False),
        ("python", "helper.py", False), ("text", None, False), ("text", None, False), ("python", None, True),
    ]
    assert blocks[1].text == 'echo "from bash: $(cat note.txt)"\n'  # the list item's indentation is taken off
    assert fence_problems(blocks) == []


def test_runner_executes_every_example_in_one_interpreter(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    workdir = tmp_path / "reader"
    workdir.mkdir()
    runs = run_page(page, workdir, block_env())
    assert [r.block.line for r in runs] == [b.line for b in parse_blocks(page) if b.runs]
    assert runs[1].stdout == "from bash: written, not run\n"
    assert runs[2].stdout == "42\n"  # `x` from the first block: one namespace per page


@pytest.mark.parametrize("fence, expected", [
    ("```", "fence without a language"),
    ("```sh", "write ```bash"),
    ("```py", "write ```python"),
    ("```console", "write ```bash"),
    ("```rust", "unknown fence language 'rust'"),
])
def test_fences_that_would_escape_the_run_are_refused(tmp_path: Path, fence: str, expected: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{fence}\necho hi\n```\n")
    problems = fence_problems(parse_blocks(page))
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_failing_example_names_its_page_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('ran')\n```\n\n```bash\necho partial; false\n```\n\n```python\nprint('never')\n```\n")
    workdir = tmp_path / "reader"
    workdir.mkdir()
    with pytest.raises(AssertionError, match=r"page.md:5: the bash block exited with status 1 \(1 of 3 examples"):
        run_page(page, workdir, block_env())
