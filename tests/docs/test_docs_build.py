"""The user guide builds with mkdocs --strict, without a single warning."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from doc_blocks import DOCS_DIR, REPO_ROOT, venv_python


def test_mkdocs_build_strict_has_no_warnings(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [venv_python(), "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO_ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0 and not warnings, (
        f"mkdocs build --strict failed (exit {proc.returncode}):\n" + "\n".join(warnings or output.splitlines()[-30:])
    )
    # Every page of docs/ is in the site (the nav lists it, or strict mode would have said so above).
    built = {p.name for p in DOCS_DIR.glob("*.md")}
    missing = [name for name in built
               if not (site / ("index.html" if name == "index.md" else Path(name).stem) ).exists()]
    assert not missing, f"pages of docs/ missing from the built site: {missing}"
    assert "<a id=\"r6\"></a>" in (site / "reference" / "index.html").read_text(encoding="utf-8")
