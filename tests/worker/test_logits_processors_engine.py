"""Logits processors in a real (in-process, `uni`) engine on the tiny Llama, with chunked prefill and
async scheduling: requests join mid-way (their prompts prefilled over several steps), leave at
different lengths and wait for a free slot, so rows are added, removed and moved.

The recording processor (tests/support/recording_logits.py) is named through the `logits_processors`
option with the allow-list empty, so no installed entry point interferes. It bans per-request tokens
and records, at each apply, each row's request and output tokens so far.
"""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.errors import ConfigError
from support.recording_logits import RecordingBanProcessor

PROMPTS = [list(range(3, 23)), [40, 41, 42, 43, 44, 45, 46], list(range(100, 133)), [7, 8, 9]]
MAX_TOKENS = [3, 9, 6, 12]
OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20, plugins="",
               max_num_batched_tokens=16, max_num_seqs=3)
PATH = "support.recording_logits:RecordingBanProcessor"


def params(index: int, ban: list[int] | None = None) -> SamplingParams:
    extra = {"tag": index} if ban is None else {"tag": index, "ban": ban}
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[index], ignore_eos=True, extra_args=extra)


def tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


@pytest.fixture(scope="module")
def plain(llama_path) -> list[list[int]]:
    """Each request alone, without any processor."""
    with LLM(llama_path, **OPTIONS) as llm:
        return [tokens(llm.generate({"prompt_token_ids": p}, params(i)))[0] for i, p in enumerate(PROMPTS)]


def test_rows_follow_their_requests_through_joins_leaves_and_chunked_prefill(llama_path, plain):
    bans = {0: plain[0][:1], 2: plain[2][:2]}  # two requests ban their own first greedy tokens
    RecordingBanProcessor.applies.clear()
    with LLM(llama_path, logits_processors=[PATH], **OPTIONS) as llm:
        batched = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                      [params(i, bans.get(i)) for i in range(len(PROMPTS))]))
        applies = list(RecordingBanProcessor.applies)
        solo = [tokens(llm.generate({"prompt_token_ids": PROMPTS[i]}, params(i, bans[i])))[0] for i in bans]

    # Every apply: the processor knows exactly the rows the logits have.
    for num_rows, seen in applies:
        assert len(seen) == num_rows and all(tag is not None for tag, _ in seen)
    # The batch really changed shape while it ran (else this test would prove little).
    assert len({num_rows for num_rows, _ in applies}) > 1

    # Requests without a ban are untouched; with one, the batch gives what the request gets alone,
    # and the banned tokens never appear.
    assert batched[1] == plain[1] and batched[3] == plain[3]
    assert [batched[i] for i in bans] == solo
    for index, banned in bans.items():
        assert not set(banned) & set(batched[index]) and batched[index] != plain[index]

    # At each apply a request's output list held exactly the tokens sampled before it (async
    # scheduling runs ahead in the engine core, not in the worker): 0, 1, 2, ... tokens of the result.
    for tag, final in enumerate(batched):
        prefixes = [output for _, seen in applies for row_tag, output in seen if row_tag == tag]
        assert prefixes == [final[:n] for n in range(len(final))]


def test_a_path_that_is_not_a_logits_processor_fails_start_up_naming_the_option(llama_path):
    with pytest.raises(ConfigError, match=r"logits_processors\[0\]: asyncengine:LLM is .*not a subclass of "
                                          r"asyncengine.plugins_api.LogitsProcessor") as info:
        LLM(llama_path, logits_processors=["asyncengine:LLM"], **OPTIONS)
    assert info.value.field == "logits_processors"


def test_a_path_that_does_not_import_fails_start_up_naming_the_option(llama_path):
    with pytest.raises(ConfigError, match=r"logits_processors\[1\].*no_such_module") as info:
        LLM(llama_path, logits_processors=[PATH, "no_such_module:Thing"], **OPTIONS)
    assert info.value.field == "logits_processors"
