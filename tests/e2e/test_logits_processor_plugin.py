"""The first-party logits-processor plugin (plugins/asyncengine-logits-example), installed as a real
distribution, in a multiprocess engine (engine core and worker in processes of their own), through
both doors: its entry point (group asyncengine.logits_processors) and the `logits_processors` option
with the allow-list excluding the entry point.

A user's script runs in a fresh interpreter with exactly that distribution on PYTHONPATH; the
processor appends a line to AE_PLUGIN_RECORD on its first apply, naming its pid and process role.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DIST = "asyncengine-logits-example"
CLASS_PATH = "ae_logits_example:BannedTokensProcessor"

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import RequestError

model, door = sys.argv[1], sys.argv[2]
options = dict(in_process=False, distributed_executor_backend="mp", skip_tokenizer_init=True, max_model_len=512,
               kv_cache_memory_bytes=8 * 2**20)
if door in ("config", "both"):
    options["logits_processors"] = [sys.argv[3]]
if door == "config":
    options["plugins"] = ""  # the allow-list leaves the entry point out: only the option names the class
A, B = {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}


def greedy(**extra):
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **extra)


def tokens(outputs):
    return [list(output.outputs[0].token_ids) for output in outputs]


result = {"pid": os.getpid()}
with LLM(model, **options) as llm:
    result["plain"] = tokens(llm.generate([A, B], greedy()))
    result["solo_b"] = tokens(llm.generate(B, greedy()))[0]
    banned = result["plain"][0][:2]
    result["banned"] = banned
    result["mixed"] = tokens(llm.generate([A, B], [greedy(extra_args={"banned_token_ids": banned}), greedy()]))
    errors = {}
    for name, extra in (("not a list", {"banned_token_ids": 5}), ("not ints", {"banned_token_ids": ["x"]})):
        try:
            llm.generate(A, greedy(extra_args=extra))
        except RequestError as error:
            errors[name] = [error.field, str(error)]
    try:
        greedy(extra_args={"when": object()})
    except RequestError as error:
        errors["not msgpack"] = [error.field, str(error)]
    result["errors"] = errors
    result["after_errors"] = tokens(llm.generate(A, greedy()))[0]  # the engine still serves
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


def run(tmp_path: Path, env: dict[str, str], model: str, door: str) -> tuple[dict, list[dict]]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), model, door, CLASS_PATH], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    record = Path(env["AE_PLUGIN_RECORD"])
    lines = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return json.loads(result.stdout.strip().splitlines()[-1]), lines


@pytest.mark.extension_point("E6", "C4")
@pytest.mark.parametrize("door", ["entry point", "config"])
def test_banned_tokens_through_each_door(llama_path, tmp_path, plugin_env, door):
    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(tmp_path / "record.jsonl"))
    outcome, records = run(tmp_path, env, llama_path, door.split()[0])

    plain_a, plain_b = outcome["plain"]
    mixed_a, mixed_b = outcome["mixed"]
    # Greedy without extra_args is untouched; with the first two greedy tokens banned they never
    # appear, so the output differs; the request beside it in the batch equals its solo output.
    assert plain_b == outcome["solo_b"] and outcome["after_errors"] == plain_a
    assert not set(outcome["banned"]) & set(mixed_a) and mixed_a != plain_a
    assert mixed_b == outcome["solo_b"]

    # Refused in the frontend, naming the field, and the engine goes on.
    errors = outcome["errors"]
    assert errors["not a list"][0] == errors["not ints"][0] == "extra_args.banned_token_ids"
    assert "must be a list" in errors["not a list"][1] and "non-negative integers" in errors["not ints"][1]
    assert errors["not msgpack"][0] == "extra_args" and "msgpack" in errors["not msgpack"][1]

    # apply ran in the worker process, not in the script's: one instance there (one first apply).
    assert records == [{"what": "logits processor apply", "pid": records[0]["pid"], "role": "worker rank 0"}]
    assert records[0]["pid"] != outcome["pid"]


def test_the_same_class_from_both_doors_is_built_once(llama_path, tmp_path, plugin_env):
    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(tmp_path / "record.jsonl"))
    outcome, records = run(tmp_path, env, llama_path, "both")
    assert not set(outcome["banned"]) & set(outcome["mixed"][0])
    assert [line["role"] for line in records] == ["worker rank 0"]  # two instances would record twice


@pytest.mark.extension_point("C4")
def test_a_configured_path_that_is_no_logits_processor_fails_start_up(llama_path, tmp_path, plugin_env):
    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(tmp_path / "record.jsonl"))
    script = tmp_path / "bad_path.py"
    script.write_text(
        "import sys\n"
        "from asyncengine import LLM\n"
        "from asyncengine.errors import ConfigError\n"
        "try:\n"
        "    LLM(sys.argv[1], in_process=False, distributed_executor_backend='mp', skip_tokenizer_init=True,\n"
        "        max_model_len=512, kv_cache_memory_bytes=8 * 2**20, plugins='',\n"
        "        logits_processors=['ae_logits_example:banned_token_ids'])\n"
        "except ConfigError as error:\n"
        "    print(error.field, '|', error)\n"
    )
    result = subprocess.run([sys.executable, str(script), llama_path], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    field, _, message = result.stdout.strip().partition(" | ")
    assert field == "logits_processors"
    assert "failed in start-up phase 'config hooks'" in message
    assert "logits_processors[0]: ae_logits_example:banned_token_ids is <function" in message
    assert "not a subclass of asyncengine.plugins_api.LogitsProcessor" in message
