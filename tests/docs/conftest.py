"""The docs tests' summary: per page, how many code examples ran of those present."""

from __future__ import annotations

from doc_blocks import summary_lines


def pytest_terminal_summary(terminalreporter) -> None:
    for line in summary_lines():
        terminalreporter.write_line(line)
