"""Every request field bounded before the engine core sees it (docs/sampling.md, "Limits").

SamplingParams holds each integer within int64 and each float within float32 (the workers' tensor
types), naming the field; the InputProcessor adds the bounds that need the model and the engine:
top_k against the vocabulary, n against max_n, min_tokens and max_tokens against the context. Last,
the defect that started this: `top_k` 2^63 used to reach the worker and kill the engine.
"""

from __future__ import annotations

import anyio
import pytest

from asyncengine import AsyncEngine, EngineConfig, RequestError, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.frontend.processor import InputProcessor, child_seed

from frontend.test_processor import MAX_MODEL_LEN, VOCAB, model_config, tokens

INT64_MAX = 2**63 - 1

OUT_OF_RANGE = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**64 - 1}, "top_k"),
    ({"top_k": 10**30}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 2**63}, "n"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
    ({"logprobs": 2**64}, "logprobs"),
    ({"stop_token_ids": [1, 2**63]}, "stop_token_ids"),
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 as a float32: a division by zero
    ({"presence_penalty": 10**400}, "presence_penalty"),
    ({"top_p": 10**400}, "top_p"),
]


@pytest.mark.parametrize("kwargs, field", OUT_OF_RANGE, ids=[str(k) for k, _ in OUT_OF_RANGE])
def test_values_outside_the_engines_types_are_request_errors_naming_the_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in info.value.message


@pytest.mark.parametrize("kwargs", [{"top_k": INT64_MAX}, {"seed": INT64_MAX}, {"seed": -(2**63)},
                                    {"max_tokens": INT64_MAX}, {"temperature": 3e38}])
def test_the_edges_of_the_engines_types_are_accepted(kwargs):
    assert SamplingParams(**kwargs).explicit_fields == frozenset(kwargs)


def test_extra_args_nested_too_deep_to_encode_is_a_request_error():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RequestError) as info:
        SamplingParams(extra_args={"x": deep})
    assert info.value.field == "extra_args"


# --- bounds that need the model or the engine (InputProcessor) --------------------------------------


def processor(**engine) -> InputProcessor:
    return InputProcessor(EngineConfig(**engine), model_config(), tokenizer=None)


def test_top_k_at_or_above_the_vocabulary_is_top_k_off():
    for top_k in (VOCAB, VOCAB + 1, INT64_MAX):
        assert processor().process("r", tokens(3), SamplingParams(top_k=top_k)).children[0].sampling.top_k == 0
    assert processor().process("r", tokens(3), SamplingParams(top_k=VOCAB - 1)).children[0].sampling.top_k == VOCAB - 1


def test_n_above_max_n_is_refused_naming_n():
    assert EngineConfig().max_n == 128
    with pytest.raises(RequestError) as info:
        processor().process("r", tokens(3), SamplingParams(n=4096))
    assert info.value.field == "n" and "max_n=128" in info.value.message
    assert len(processor().process("r", tokens(3), SamplingParams(n=128)).children) == 128
    with pytest.raises(RequestError):
        processor(max_n=4).process("r", tokens(3), SamplingParams(n=5))


@pytest.mark.parametrize("fields, field", [({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
                                           ({"allowed_token_ids": [0, VOCAB]}, "allowed_token_ids"),
                                           ({"stop_token_ids": [VOCAB + 5]}, "stop_token_ids")])
def test_token_ids_past_the_vocabulary_are_refused_before_a_worker_indexes_with_them(fields, field):
    # (The worker trusts the wire: it no longer checks the ids it indexes its logits with.)
    with pytest.raises(RequestError) as info:
        processor().process("r", tokens(3), SamplingParams(**fields))
    assert info.value.field == field and "outside the vocabulary" in info.value.message
    last = {"logit_bias": {VOCAB - 1: 1.0}, "allowed_token_ids": [0, VOCAB - 1], "stop_token_ids": [VOCAB - 1]}[field]
    assert processor().process("r", tokens(3), SamplingParams(**{field: last})).children


def test_max_n_must_be_positive():
    with pytest.raises(ConfigError) as info:
        EngineConfig(max_n=0)
    assert info.value.field == "max_n"


def test_min_tokens_past_the_context_is_refused_not_clipped():
    # Before: 2^63 was cut to the room left, and the request generated to max_model_len.
    with pytest.raises(RequestError) as info:
        processor().process("r", tokens(3), SamplingParams(min_tokens=2**63 - 1, max_tokens=None))
    assert info.value.field == "min_tokens"
    assert f"room for {MAX_MODEL_LEN - 3}" in info.value.message


def test_children_seeds_stay_within_int64():
    assert child_seed(5, 2) == 7
    assert child_seed(INT64_MAX, 1) == -(2**63)
    out = processor().process("r", tokens(3), SamplingParams(n=3, seed=INT64_MAX))
    seeds = [child.sampling.seed for child in out.children]
    assert seeds == [INT64_MAX, -(2**63), -(2**63) + 1]
    assert all(-(2**63) <= seed <= INT64_MAX for seed in seeds)


def test_completions_of_one_request_share_a_parent_id_unique_per_submission():
    p = processor()
    first = p.process("r", tokens(3), SamplingParams(n=2))
    again = p.process("r", tokens(3), SamplingParams(n=2))
    assert len({child.parent_id for child in first.children}) == 1
    assert first.children[0].parent_id != again.children[0].parent_id
    assert p.process("r", tokens(3), SamplingParams(n=1)).children[0].parent_id is None


# --- the engine: a bad top_k never reaches the worker ------------------------------------------------


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


OPTIONS = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=4 * 2**20, plugins="")


@pytest.mark.anyio
async def test_top_k_past_int64_is_refused_and_the_engine_serves_on(llama_path):
    # On main, 2^63 passed SamplingParams and the worker died with "Overflow when unpacking long long".
    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with AsyncEngine.start(EngineConfig(model=llama_path, **OPTIONS)) as engine:
        for top_k in (2**63, 2**64 - 1):
            with pytest.raises(RequestError) as info:
                async for _ in engine.generate(prompt, SamplingParams(top_k=top_k, max_tokens=4)):
                    pass
            assert info.value.field == "top_k"
        with anyio.fail_after(120):
            deltas = [out async for out in engine.generate(prompt, SamplingParams(max_tokens=4, top_k=5))]
        assert deltas[-1].finished and sum(len(d.outputs[0].token_ids) for d in deltas if d.outputs) == 4
        assert engine.is_running
