"""The blocking LLM API on the default model: text in and out, chat, stops, n, seeds, logprobs."""

from __future__ import annotations

import pytest

from asyncengine import LLM, RequestError, SamplingParams
from support.engine_checks import assert_all_blocks_free

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with LLM(str(default_model_dir), kv_cache_memory_bytes=256 * 2**20, max_model_len=1024) as llm:
        yield llm


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_chat_answers_paris_and_stops_at_eos(llm):
    [output] = llm.chat(FRANCE, greedy(max_tokens=64))
    completion = output.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop" and completion.stop_reason is None  # <|im_end|>, the EOS
    assert completion.token_ids[-1] == 2
    assert "<|im_end|>" not in completion.text
    assert output.prompt.startswith("<|im_start|>")


def test_eos_text_stays_out_even_without_skipping_special_tokens(llm):
    [output] = llm.chat(FRANCE, greedy(max_tokens=64, skip_special_tokens=False))
    assert output.outputs[0].finish_reason == "stop"
    assert "<|im_end|>" not in output.outputs[0].text


def test_text_prompt_and_outputs_in_input_order(llm):
    prompts = ["The capital of Italy is", "1, 2, 3, 4,", "The capital of Italy is"]
    outputs = llm.generate(prompts, greedy(max_tokens=8))
    assert [o.prompt for o in outputs] == prompts
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    assert outputs[1].prompt_token_ids == tokenizer.encode(prompts[1])
    assert outputs[1].outputs[0].finish_reason == "length" and len(outputs[1].outputs[0].token_ids) == 8


def test_one_sampling_params_per_prompt(llm):
    outputs = llm.generate(["a", "b"], [greedy(max_tokens=3), greedy(max_tokens=5)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    with pytest.raises(RequestError) as info:
        llm.generate(["a", "b"], [greedy()])
    assert info.value.field == "sampling_params"


def test_stop_string_spanning_tokens(llm):
    [plain] = llm.generate("Once upon a time", greedy(max_tokens=24, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    ids, text = plain.outputs[0].token_ids, plain.outputs[0].text
    # A stop string made of the end of token 4's text and the start of token 5's: it spans two tokens.
    upto4 = tokenizer.decode(ids[:5])
    stop = upto4[-2:] + tokenizer.decode(ids[:6])[len(upto4) :][:2]
    assert len(stop) == 4 and stop in text
    [cut] = llm.generate("Once upon a time", greedy(max_tokens=24, ignore_eos=True, stop=[stop]))
    completion = cut.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    [kept] = llm.generate("Once upon a time", greedy(max_tokens=24, stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    [plain] = llm.generate("Once upon a time", greedy(max_tokens=12, ignore_eos=True))
    ids = plain.outputs[0].token_ids
    target = ids[4]
    first = ids.index(target)
    [cut] = llm.generate("Once upon a time", greedy(max_tokens=12, stop_token_ids=[target]))
    completion = cut.outputs[0]
    assert completion.token_ids == ids[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == target


def test_min_tokens_suppresses_eos(llm):
    [natural] = llm.chat(FRANCE, greedy(max_tokens=64))
    length = len(natural.outputs[0].token_ids)
    [longer] = llm.chat(FRANCE, greedy(max_tokens=64, min_tokens=length + 5))
    assert len(longer.outputs[0].token_ids) >= length + 5


def test_n_completions_with_a_seed_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    [first] = llm.generate("Tell me a story:", params)
    [second] = llm.generate("Tell me a story:", params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3  # three different draws


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    [alone] = llm.generate("Tell me a story:", seeded)
    crowd = llm.generate(
        ["Hi", "Tell me a story:", "Why?"], [SamplingParams(temperature=1.0, max_tokens=16)] + [seeded] + [greedy()]
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_and_cumulative_logprob(llm):
    [output] = llm.generate("The capital of France is", greedy(max_tokens=5, logprobs=3))
    completion = output.outputs[0]
    assert len(completion.logprobs) == 5
    total = 0.0
    for token_id, step in zip(completion.token_ids, completion.logprobs):
        assert token_id in step and len(step) <= 4
        assert step[token_id] == max(step.values())  # greedy picks the most likely token
        total += step[token_id]
    assert completion.cumulative_logprob == pytest.approx(total)


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(RequestError) as info:
        llm.generate(["fine", {"prompt_token_ids": [1, 10**9]}], greedy(max_tokens=4))
    assert info.value.field == "prompt_token_ids"
    assert_all_blocks_free(llm.get_scheduler_stats())
    [ok] = llm.generate("fine", greedy(max_tokens=2))
    assert ok.finished
