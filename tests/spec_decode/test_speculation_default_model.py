"""Speculative decoding on the default model (SmolLM2-135M-Instruct, float32), issue 37's acceptance 1 and 2: with
the n-gram proposer, greedy output is token-identical to the same engine without speculation, on prompts whose
answers copy their input (where drafts are accepted) and on others; structured output under speculation emits
only schema-valid text while unconstrained requests beside it speculate; vLLM's speculative counters reach
/metrics' exposition (both names); every KV block is free afterwards.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from asyncengine import LLM, SamplingParams, StructuredOutputsParams
from asyncengine.server.metrics import PrometheusStatLogger
from support.engine_checks import assert_all_blocks_free

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
OPTIONS = dict(kv_cache_memory_bytes=64 * 2**20, max_model_len=512, max_num_batched_tokens=128)
QUESTIONS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Fix the typo and repeat the code: def add(a, b):\n    retrun a + b",
    "Write a haiku about the sea.",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """The engine without speculation, then the same with n-gram speculation (one at a time: memory)."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with LLM(str(default_model_dir), **OPTIONS) as llm:
        plain = llm.chat(messages, params)
    with LLM(str(default_model_dir), speculative_config=NGRAM, **OPTIONS) as llm:
        speculative = llm.chat(messages, params)
        constrained = llm.chat(
            [[{"role": "user", "content": "Give a person's name and age as JSON."}]] + messages[:1],
            [SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA)), params])
        stats = llm.get_scheduler_stats()
    return plain, speculative, constrained, stats


def test_greedy_output_is_token_identical_with_ngram(engines):
    plain, speculative, _, stats = engines
    for mine, theirs in zip(speculative, plain, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].text == theirs.outputs[0].text
    # The copying answers gave the proposer drafts the target accepted.
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(stats)


def test_structured_output_under_speculation_is_schema_valid(engines):
    plain, _, constrained, _ = engines
    json_output, beside = constrained
    jsonschema.validate(json.loads(json_output.outputs[0].text), SCHEMA)
    assert json_output.outputs[0].finish_reason == "stop"
    assert beside.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_the_counters_reach_metrics_under_both_names(engines):
    *_, stats = engines
    stat_logger = PrometheusStatLogger(model_name="m")
    stat_logger.update_scheduler_stats(stats)
    text = stat_logger.render()[0].decode()
    for ours, vllm, value in (
        ("asyncengine:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total", stats.spec_decode_num_drafts),
        ("asyncengine:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
         stats.spec_decode_num_draft_tokens),
        ("asyncengine:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
         stats.spec_decode_num_accepted_tokens),
    ):
        assert f'{ours}{{model_name="m"}} {float(value)}' in text
        assert f'{vllm}{{engine="0",model_name="m"}} {float(value)}' in text
    for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{position}"}} '
                f'{float(value)}') in text
