"""A speculative proposer from a plugin (issue 37, acceptance 3; row R13): the first-party distribution
plugins/asyncengine-spec-decode-example, installed as a real distribution into a temporary target, is named by
speculative_config's `method` in a multiprocess engine (engine core and worker in processes of their own):
the frontend checks the name, the worker builds it (its start-up record names the class and the plugin), every
propose call runs in the worker process, and the engine counts its drafts in vLLM's speculative counters.
The output is the target's: token-identical to the same engine without speculation (greedy, float32).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

DIST, PLUGIN, METHOD = "asyncengine-spec-decode-example", "ae_spec_decode_example", "ae_repeat_last"

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, directory, plugin, method = sys.argv[1:5]
prompts = [{"prompt_token_ids": [5, 9, 9, 9, 9, 9, 9]}, {"prompt_token_ids": [11, 12, 13, 14]}]
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=4 * 2**20, dtype="float32",
               plugins=plugin)
result = {"pid": os.getpid()}
with LLM(model, **options) as llm:
    result["plain"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
os.environ["AE_PLUGIN_RECORD"] = os.path.join(directory, "record.jsonl")
with LLM(model, in_process=False, distributed_executor_backend="mp", startup_trace=os.path.join(directory, "trace.json"),
         speculative_config={"method": method, "num_speculative_tokens": 3}, **options) as llm:
    result["speculative"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.get_scheduler_stats()
result["stats"] = {name: getattr(stats, name) for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                   "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "kv_cache_usage")}
print(json.dumps(result))
"""


@pytest.mark.extension_point("R13")
def test_a_plugins_proposer_runs_in_the_worker_and_is_counted(tiny_model, tmp_path: Path, plugin_env):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    model = tiny_model("llama").path
    done = subprocess.run([sys.executable, str(script), str(model), str(tmp_path), PLUGIN, METHOD],
                          capture_output=True, text=True, env=plugin_env(DIST), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])

    # The worker built the plugin's class for the method, and says so in its start-up report.
    trace = read_trace(tmp_path / "trace.json")
    (reason,) = [r.reason for r in trace if r.plugin == "speculative proposer"]
    assert [r.role for r in trace if r.plugin == "speculative proposer"] == ["worker rank 0"]
    assert reason == (f"method {METHOD}: ae_spec_decode_example:RepeatLastProposer (registered by plugin "
                      f"'{PLUGIN}' ({DIST})), num_speculative_tokens=3")
    # Every propose call ran in the worker process (not the script's, nor the engine core's).
    calls = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert calls and {c["role"] for c in calls} == {"worker rank 0"}
    assert len({c["pid"] for c in calls}) == 1 and calls[0]["pid"] != outcome["pid"]
    assert [c["call"] for c in calls] == list(range(1, len(calls) + 1))
    # The engine counted its drafts: each verification at most the drafts the plugin proposed before it.
    stats = outcome["stats"]
    assert 0 < stats["spec_decode_num_drafts"] <= len(calls) * 2
    assert 0 < stats["spec_decode_num_draft_tokens"] <= sum(c["drafts"] for c in calls)
    assert stats["spec_decode_num_accepted_tokens"] == sum(stats["spec_decode_num_accepted_tokens_per_pos"])
    assert stats["kv_cache_usage"] == 0.0
    # A proposer changes speed only: the tokens are the target's.
    assert outcome["speculative"] == outcome["plain"]
