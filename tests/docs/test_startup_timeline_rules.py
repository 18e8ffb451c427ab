"""The rules of the start-up plan (asyncengine/cli/reports/timeline_rules.py), as the page reads them.

docs/assets/startup-timeline-rules.json must be what `asyncengine plugins timeline --export-rules` writes
(regenerate it with that command after a change to the groups, registries, hooks or phases), and the
parts of the rules not drawn from a table must agree with the code that really starts processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.config.engine import config_from_dict
from asyncengine.plugin_runtime import groups as g

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "docs" / "assets" / "startup-timeline-rules.json"


def test_the_committed_rules_are_what_the_cli_exports(tmp_path):
    exported = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "timeline", "--export-rules", "-"],
                              capture_output=True, text=True, timeout=60)
    assert exported.returncode == 0, exported.stderr
    assert COMMITTED.read_text() == exported.stdout, (
        f"{COMMITTED.relative_to(REPO)} is stale: run `asyncengine plugins timeline --export-rules "
        f"{COMMITTED.relative_to(REPO)}`")
    written = tmp_path / "rules.json"
    to_file = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "timeline", "--export-rules",
                              str(written)], capture_output=True, text=True, timeout=60)
    assert to_file.returncode == 0, to_file.stderr
    assert written.read_text() == exported.stdout


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("in_process", [True, False])
def test_the_processes_and_roles_of_the_rules_are_those_of_a_real_start(tp, in_process):
    """The roles each planned process plays are the ones the frontend, the engine-core process and the
    worker processes pass to their plugin phases."""
    from asyncengine.plugin_runtime.placement import engine_core_roles, frontend_roles
    from asyncengine.cli.reports.timeline import plan_start

    config = config_from_dict({"in_process": in_process, "tensor_parallel_size": tp, "plugins": ""})
    rules = json.loads(COMMITTED.read_text())
    assert config.executor_backend == rules["default_backend"]["one_rank" if tp == 1 else "several_ranks"]

    plans = {plan.role: plan for plan in plan_start(config)}
    assert set(plans["frontend"].plays) == frontend_roles(config)
    if not in_process:  # the engine-core process's roles (in-process, the frontend plays them)
        assert set(plans["engine core"].plays) == engine_core_roles(config)
    ranks = [role for role in plans if role.startswith("worker rank")]
    # worker processes exactly when the executor places workers in processes (mp), one per rank
    assert ranks == ([f"worker rank {rank}" for rank in range(tp)] if config.executor_backend == "mp" else [])
    assert all(plans[role].plays == [g.WORKER] for role in ranks)

