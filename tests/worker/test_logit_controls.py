"""logit_bias, allowed_token_ids and bad_words (asyncengine/worker/logit_controls.py), greedy, on the tiny
Llama with the byte-level tokenizer (every byte one token), in-process; and through the server
(Quart's test client), where bad values are 400s naming the field.

Reference logits are transformers' (the tiny model's own float32 module), for the first token of a
prompt: the engine's first greedy token under a control must be the argmax of those logits after the
control."""

from __future__ import annotations

import shutil

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.server.config import ServerConfig
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker import sampler as sampler_module
from asyncengine.worker.logit_controls import RequestLogitControls, apply_logit_controls
from asyncengine.worker.sampler import Sampler, SamplingRow
from support.hf_reference import TIE_GAP
from support.in_process_server import in_process_server
from support.tiny_tokenizer import save_tiny_tokenizer

PROMPT = [5, 80, 33, 12, 200, 7, 64]
OTHER_PROMPT = [40, 41, 42, 43, 44]
OPTIONS = dict(max_model_len=256, kv_cache_memory_bytes=8 * 2**20, plugins="", max_num_seqs=4)
LETTERS = "abcdefghij"


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def model_dir(llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("logit-controls") / "llama"
    shutil.copytree(llama.path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), **OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def first_logits(llama) -> torch.Tensor:
    """transformers' float32 logits for the token after PROMPT."""
    with torch.inference_mode():
        return llama.hf_model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()


def greedy(max_tokens: int = 8, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def run(llm, prompt, params) -> list[int]:
    return list(llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)


def letter_ids(llm) -> list[int]:
    return [llm.get_tokenizer().encode(c, add_special_tokens=False)[0] for c in LETTERS]


# -- logit_bias ----------------------------------------------------------------------------------------


def test_a_bias_of_100_makes_every_token_that_one(llm):
    target = 123
    plain = run(llm, PROMPT, greedy())
    assert target not in plain  # else the bias proves nothing
    assert run(llm, PROMPT, greedy(logit_bias={str(target): 100})) == [target] * 8


def test_a_bias_of_minus_100_on_the_greedy_token_gives_the_next_best(llm, first_logits):
    top = first_logits.topk(3)
    assert float(top.values[1] - top.values[2]) > TIE_GAP  # the second best is not a tie
    plain = run(llm, PROMPT, greedy())
    assert plain[0] == int(top.indices[0])
    biased = run(llm, PROMPT, greedy(logit_bias={plain[0]: -100}))
    assert biased[0] == int(top.indices[1])


# -- allowed_token_ids ---------------------------------------------------------------------------------


def test_allowed_token_ids_keep_every_token_in_the_set(llm, first_logits):
    plain = run(llm, PROMPT, greedy())
    # Three ids away from the top of the reference logits: the unconstrained run never picks them first.
    allowed = [int(t) for t in first_logits.argsort(descending=True)[[400, 10, 700]]]
    assert plain[0] not in allowed
    constrained = run(llm, PROMPT, greedy(allowed_token_ids=allowed))
    assert set(constrained) <= set(allowed)
    assert constrained[0] == allowed[int(first_logits[allowed].argmax())] == allowed[1]


# -- bad_words -----------------------------------------------------------------------------------------


def pairs(tokens: list[int]) -> list[tuple[int, int]]:
    return list(zip(tokens, tokens[1:]))


def test_a_two_token_bad_word_never_appears_and_the_output_up_to_it_is_unchanged(llm):
    allowed = letter_ids(llm)  # generated text made of letters, so any two of them form a word
    plain = run(llm, PROMPT, greedy(16, allowed_token_ids=allowed))
    first, second = plain[0], plain[1]
    word = llm.get_tokenizer().decode([first, second])
    assert len(word) == 2 and word.isalpha()
    banned = run(llm, PROMPT, greedy(16, allowed_token_ids=allowed, bad_words=[word]))
    assert (first, second) in pairs(plain)
    assert (first, second) not in pairs(banned)
    assert banned[0] == first and banned[1] != second  # only the last token of the word, and only after the first


def test_a_one_token_bad_word_is_always_banned(llm):
    allowed = letter_ids(llm)
    plain = run(llm, PROMPT, greedy(16, allowed_token_ids=allowed))
    word = llm.get_tokenizer().decode([plain[0]])
    banned = run(llm, PROMPT, greedy(16, allowed_token_ids=allowed, bad_words=[word]))
    assert plain[0] not in banned and set(banned) <= set(allowed)


def test_bad_words_are_tokenized_with_and_without_a_leading_space(llm):
    """vLLM's rule: the spaced form counts only when it has as many tokens and another first token; with
    a byte-level tokenizer and no merges ' ab' is one token longer, so only 'ab' itself is banned."""
    processed = llm.engine.process_request({"prompt_token_ids": PROMPT}, greedy(bad_words=["ab", " c"]))
    encode = llm.get_tokenizer().encode
    assert processed.children[0].sampling.bad_words_token_ids == (
        tuple(encode("ab", add_special_tokens=False)), tuple(encode("c", add_special_tokens=False)))


# -- batches -------------------------------------------------------------------------------------------


def test_a_request_without_controls_gets_its_solo_tokens_beside_one_with_them(llm):
    allowed = letter_ids(llm)
    constrained = greedy(12, allowed_token_ids=allowed, logit_bias={allowed[3]: 5.0},
                         bad_words=[llm.get_tokenizer().decode(allowed[:2])])
    solo_plain = run(llm, OTHER_PROMPT, greedy(12))
    solo_constrained = run(llm, PROMPT, constrained)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER_PROMPT}],
                           [constrained, greedy(12)])
    assert list(outputs[0].outputs[0].token_ids) == solo_constrained
    assert list(outputs[1].outputs[0].token_ids) == solo_plain
    assert not set(solo_plain) <= set(allowed)  # the plain request really is unconstrained


def test_apply_matches_a_row_by_row_reference():
    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    specs = [
        SamplingOptions(logit_bias={3: 2.5, 7: -1.0}, allowed_token_ids=(3, 7, 9, 11)),
        None,
        SamplingOptions(bad_words_token_ids=((5,), (1, 2, 8), (2, 9))),
        SamplingOptions(logit_bias={0: 100.0}),
    ]
    outputs = [[], [4], [6, 1, 2], []]
    controls = [None if s is None else RequestLogitControls.build(s, vocab, torch.device("cpu")) for s in specs]
    expected = logits.clone()
    expected[0, [t for t in range(vocab) if t not in (3, 7, 9, 11)]] = float("-inf")
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    expected[2, [5, 8, 9]] = float("-inf")  # 5 always; 8 as 1, 2 were just generated; 9 as 2 was
    expected[3, 0] += 100.0
    assert torch.equal(apply_logit_controls(logits.clone(), controls, outputs), expected)


def test_a_batch_without_controls_never_builds_any(monkeypatch, cpu_platform):
    """No request with controls: the sampler does not call into logit_controls at all."""
    def refuse(*args):
        raise AssertionError("logit controls applied to a batch without any")

    monkeypatch.setattr(sampler_module, "apply_logit_controls", refuse)
    sampler = Sampler(20, torch.device("cpu"), seed=0)
    rows = [SamplingRow(SamplingOptions(temperature=0.0), [1], []) for _ in range(3)]
    sampler(torch.randn(3, 20), rows)
    controlled = RequestLogitControls.build(SamplingOptions(logit_bias={1: 1.0}), 20, torch.device("cpu"))
    with pytest.raises(AssertionError, match="without any"):  # the refusal can fire: a row with controls calls it
        sampler(torch.randn(1, 20), [SamplingRow(SamplingOptions(temperature=0.0), [1], [], controlled)])
    assert RequestLogitControls.build(SamplingOptions(), 20, torch.device("cpu")) is None


# -- through the server --------------------------------------------------------------------------------

AUTH = {"Authorization": "Bearer k", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(model_dir):
    with in_process_server({"model": str(model_dir), "served_model_name": "tiny", **OPTIONS},
                           ServerConfig(api_key="k")) as running:
        yield running


def body(route: str, **fields) -> dict:
    if route == "/v1/completions":
        return {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, **fields}
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            **fields}


ROUTES = ["/v1/completions", "/v1/chat/completions"]
BAD = [
    ("bias over 100", {"logit_bias": {"5": 101}}, "logit_bias", "each value of logit_bias must be at most 100"),
    ("bias id past the vocabulary", {"logit_bias": {"5000": 1}}, "logit_bias", "5000, outside the vocabulary"),
    ("non-integer key", {"logit_bias": {"five": 1}}, "logit_bias", "five"),
    ("allowed id past the vocabulary", {"allowed_token_ids": [3, 5000]}, "allowed_token_ids[1]",
     "outside the vocabulary"),
    ("no allowed ids", {"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ("empty bad word", {"bad_words": [""]}, "bad_words", "bad_words"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", BAD, ids=[case[0] for case in BAD])
def test_bad_values_are_400s_naming_the_field(server, route, case):
    import json

    _, fields, param, words = case
    status, _, raw = server.request("POST", route, body(route, **fields), AUTH)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("route", ROUTES)
def test_the_fields_reach_the_sampler_through_the_server(server, route):
    import json

    x = 3 + sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet()).index("x")
    status, _, raw = server.request("POST", route, body(route, logit_bias={str(x): 100}, bad_words=["y"],
                                                        allowed_token_ids=[x, x + 1]), AUTH)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert (choice.get("text") or choice.get("message", {}).get("content")) == "xxx"


@pytest.mark.parametrize("fields, field", [
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 1, 7: 2}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"bad_words": ["ok", ""]}, "bad_words"),
    ({"bad_words": ["\t "]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
])
def test_sampling_params_refuse_bad_values_naming_the_field(fields, field):
    from asyncengine import RequestError

    with pytest.raises(RequestError) as error:
        SamplingParams(**fields)
    assert error.value.field == field


def test_sampling_params_normalize_the_fields():
    params = SamplingParams(logit_bias={"5": 100, 9: -100.0}, allowed_token_ids=[4, 4, 2], bad_words="word")
    assert params.logit_bias == {5: 100.0, 9: -100.0}
    assert params.allowed_token_ids == [4, 2] and params.bad_words == ["word"]
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty bias changes nothing
    assert params.clone(n=2).logit_bias == params.logit_bias
