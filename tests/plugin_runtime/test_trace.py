"""The start-up trace of a real multiprocess TP=2 start, compared with `asyncengine plugins timeline`.

Four processes (frontend, engine core, two workers) each record their phases; the plan printed by
`plugins timeline --tp 2 --json` for the same settings must name the same processes, the same
phases in the same order, and the same plugins and registries in each phase.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncengine.plugin_runtime.records import OK, SKIPPED, read_trace
from asyncengine.wire.startup import StartupRecord

START = r"""
import sys
from asyncengine import LLM, SamplingParams

with LLM(sys.argv[1], in_process=False, tensor_parallel_size=2, startup_trace=sys.argv[2], skip_tokenizer_init=True,
         max_model_len=512, kv_cache_memory_bytes=8 * 2**20) as llm:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    print(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids)
"""


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def by_process(records: list[StartupRecord]) -> dict[tuple[int, str], list[StartupRecord]]:
    processes: dict[tuple[int, str], list[StartupRecord]] = {}
    for record in records:
        processes.setdefault((record.pid, record.role), []).append(record)
    return processes


def subject(record: StartupRecord) -> str | None:
    """What a record is about, in the plan's terms: a plugin by entry-point name, or a registry."""
    if record.group is not None:
        return record.plugin
    if record.plugin and record.plugin.startswith("registry:"):
        return record.plugin
    return None


def test_a_real_tp2_start_matches_the_timeline_process_by_process(llama, tmp_path, plugin_env, cli):
    env = plugin_env("ae-plugin-general")
    trace_file = tmp_path / "trace.json"
    started = subprocess.run([sys.executable, "-c", START, str(llama.path), str(trace_file)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    planned = cli(["plugins", "timeline", "--tp", "2", "--json"], env)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)

    processes = by_process(read_trace(trace_file))
    assert [role for _, role in processes] == ["frontend", "engine core", "worker rank 0", "worker rank 1"]
    assert [process["role"] for process in plan] == [role for _, role in processes]
    assert len({pid for pid, _ in processes}) == 4

    for (pid, role), records, planned_process in zip(processes, processes.values(), plan):
        phases = [record for record in records if record.plugin is None]
        assert [record.phase for record in phases] == [phase["name"] for phase in planned_process["phases"]], role
        assert all(record.outcome == OK for record in phases), role
        ends = [record.start + record.duration for record in phases]
        assert ends == sorted(ends), f"{role}: phases did not finish in order"
        for phase in planned_process["phases"]:
            seen = sorted(s for r in records if r.phase == phase["name"] and (s := subject(r)) is not None)
            assert seen == sorted(phase["subjects"]), (role, phase["name"])

    # The plugins ran where the timeline says: the general plugin in all four processes, the endpoint
    # plugin nowhere (opt-in), the logits processor in the frontend and the workers.
    def outcomes(name: str) -> list[tuple[str, str]]:
        return [(role, r.outcome) for (_, role), records in processes.items() for r in records if r.plugin == name]

    assert outcomes("ae_general") == [(role, OK) for _, role in processes]
    assert outcomes("ae_hello") == [("frontend", SKIPPED)]
    assert outcomes("ae_noop_logits") == [("frontend", OK), ("worker rank 0", OK), ("worker rank 1", OK)]

    # The children started inside the frontend's 'engine core' phase, the workers inside the core's 'start workers'.
    def window(role: str, phase: str) -> tuple[float, float]:
        (record,) = [r for (_, rl), rs in processes.items() if rl == role for r in rs
                     if r.phase == phase and r.plugin is None]
        return record.start, record.start + record.duration

    core_start, core_end = window("frontend", "engine core")
    workers_start, workers_end = window("engine core", "start workers")
    for (_, role), records in processes.items():
        if role == "frontend":
            continue
        first = min(r.start for r in records)
        assert core_start <= first <= core_end, role
        if role.startswith("worker"):
            assert workers_start <= first <= workers_end, role
