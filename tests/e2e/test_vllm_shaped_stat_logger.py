"""A stat-logger plugin with vLLM's signatures (tests/plugins/vllm-shaped-stat-logger), ported by
`asyncengine plugins port` alone: built as `cls(config, engine_index=0)`, `log_engine_initialized()`
called once at start, and `record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)`
(mm_cache_stats without a default) called after every step with mm_cache_stats=None and engine_idx=0,
where calling it with our two arguments only would kill the engine at the first step. The config it
receives reads through vLLM's sub-config views (scheduler_config.max_num_seqs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

SCRIPT = r"""
import sys
from asyncengine import LLM, SamplingParams

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
    seen = json.loads(record_file.read_text())
    assert seen["initialized"] == 1
    assert seen["records"] >= 3  # one per step: a prefill and two decodes at least
    assert seen["engine_indexes"] == [0] and seen["mm_cache_stats"] == ["None"] and seen["engine_index"] == 0
    assert seen["max_num_seqs"] == 7
