"""The server and the Python API refuse the same bad sampling values with the same message.

One table of bad values, sent both ways to the same model with the same configuration: as a completions
request to the server's API (`asyncengine serve`'s app, tests/support/in_process_server.py), and as
`SamplingParams(...)` given to `LLM.generate`. Each bound is declared once (asyncengine/sampling_bounds.py);
the server's 400 and the Python API's RequestError word it with the same function, naming the same field.
The bounds the configuration sets (--max-n, --max-logprobs, the vocabulary) are in the table too: the server
publishes them on its request Structs, the Python API's InputProcessor checks them (`check_limits`).

(The server here is the in-process one the server tests share: the session's real server, tests/server/
conftest.py, runs the default model with the CPU's default 2 GiB KV cache, more memory than this check needs.)
"""

from __future__ import annotations

import json
import shutil

import pytest

from asyncengine import LLM, RequestError, SamplingParams
from asyncengine.server.config import ServerConfig
from support.in_process_server import in_process_server
from support.server import API_KEY, MODEL_NAME
from support.tiny_tokenizer import save_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
OPTIONS = {"max_model_len": 256, "kv_cache_memory_bytes": 8 * 2**20, "plugins": "", "max_n": 4,
           "max_logprobs": 5}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("sampling-bounds") / "llama"
    shutil.copytree(tiny_model("llama").path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    with in_process_server({"model": str(model_dir), "served_model_name": MODEL_NAME, **OPTIONS},
                           ServerConfig(api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), served_model_name=MODEL_NAME, **OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def vocab(llm) -> int:
    return llm.engine.model_config.vocab_size


# (field, value); a value may depend on the vocabulary size (a callable of it).
BAD = [
    ("n", 0),
    ("n", 5),  # past --max-n
    ("temperature", -0.5),
    ("temperature", 1e39),  # past float32
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2**63),  # past int64
    ("min_p", 1.01),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-39),  # a float32 subnormal: dividing by it is not defined
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 6),  # past --max-logprobs
    ("truncate_prompt_tokens", -2),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", lambda vocab: [1, vocab]),  # past the vocabulary
    ("allowed_token_ids", lambda vocab: [vocab]),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", lambda vocab: {str(vocab): 1.0}),
]


def http_error(server, field: str, value) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **{field: value}}
    status, _, raw = server.request("POST", "/v1/completions", body, AUTH)
    assert status == 400, raw
    return json.loads(raw)["error"]


def python_error(llm, field: str, value) -> RequestError:
    with pytest.raises(RequestError) as info:
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**{"max_tokens": 2, field: value}))
    return info.value


@pytest.mark.parametrize("field, value", BAD, ids=[f"{field}={value if not callable(value) else 'vocab'}"
                                                   for field, value in BAD])
def test_the_server_and_the_python_api_refuse_a_bad_value_with_the_same_message(server, llm, vocab, field, value):
    if callable(value):
        value = value(vocab)
    http, python = http_error(server, field, value), python_error(llm, field, value)
    assert http["message"] == python.message
    assert http["param"].split("[")[0] == python.field == field
    assert field in python.message


def test_both_take_the_values_at_the_edges(server, llm, vocab):
    edges = {"n": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 2**63 - 1, "seed": -(2**63), "min_p": 1.0,
             "presence_penalty": -2.0, "repetition_penalty": 1.2e-38, "logprobs": 5, "stop_token_ids": [vocab - 1],
             "logit_bias": {str(vocab - 1): 100.0}}
    status, _, raw = server.request("POST", "/v1/completions",
                                    {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **edges}, AUTH)
    assert status == 200, raw
    [output] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, **edges))
    assert len(output.outputs) == 4 and all(len(completion.token_ids) == 2 for completion in output.outputs)
