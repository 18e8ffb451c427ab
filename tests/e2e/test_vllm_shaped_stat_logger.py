"""A stat-logger plugin with vLLM's signatures (tests/plugins/vllm-shaped-stat-logger), ported by
`asyncengine plugins port` alone: built as `cls(config, engine_index=0)`, `log_engine_initialized()`
called once at start, and `record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)`
(mm_cache_stats without a default) called after every step with mm_cache_stats=None and engine_idx=0,
where calling it with our two arguments only would kill the engine at the first step. The config it
receives reads through vLLM's sub-config views (scheduler_config.max_num_seqs). A second logger has
vLLM's own test logger's shapes (`__init__(vllm_config, engine_idx=0)`, `record(scheduler_stats,
iteration_stats, engine_idx)`), and `load_stat_logger_plugin_factories()` finds both without an engine,
as vLLM's discovery test calls it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

SCRIPT = r"""
import atexit, json, sys
from asyncengine import LLM, SamplingParams
from asyncengine.plugins_api import VllmConfig, load_stat_logger_plugin_factories

# vLLM's discovery test: the classes, loaded without an engine, and one built from a default config.
factories = load_stat_logger_plugin_factories()
instances = [cls(VllmConfig()) for cls in factories]
for instance in instances:  # these saw no engine: only the engine's own loggers write the record files
    atexit.unregister(instance._write)
print(json.dumps(sorted(type(instance).__name__ for instance in instances)))

with LLM(sys.argv[1], skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=4 * 2**20,
         max_num_seqs=7) as llm:
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True))
"""


@pytest.mark.extension_point("E4")
def test_the_ported_stat_logger_gets_vllms_calls(tiny_model, tmp_path):
    target, report = port_and_install("vllm-shaped-stat-logger", tmp_path / "dists")
    assert '"vllm.stat_logger_plugins"  ->  "asyncengine.stat_logger_plugins"' in report
    record_file = tmp_path / "stats.json"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_model("llama").path)], capture_output=True,
                            text=True, timeout=300, env=environment(target, STATS_RECORD=str(record_file)))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[0]) == ["CountingStatLogger", "MinimalStatLogger"]
    seen = json.loads(record_file.read_text())
    assert seen["initialized"] == 1
    assert seen["records"] >= 3  # one per step: a prefill and two decodes at least
    assert seen["engine_indexes"] == [0] and seen["mm_cache_stats"] == ["None"] and seen["engine_index"] == 0
    assert seen["max_num_seqs"] == 7
    minimal = json.loads((tmp_path / "stats.json.minimal").read_text())
    assert minimal["records"] >= 3 and minimal["engine_idx"] == [0] and minimal["engine_initialized"]
