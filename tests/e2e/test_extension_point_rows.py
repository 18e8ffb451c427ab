"""Rows of docs/reference.md that no other end-to-end test covers, with the first-party distributions
asyncengine-model-example and asyncengine-executor-example, each installed into a temporary target on
PYTHONPATH, in multiprocess mode (the engine core and the worker in their own processes):

- a model family from one general plugin (E1): its architecture (R1), weight format (R5) and tokenizer
  mode (R9), each observed in the process that must run it, with the manifest check passed in every
  child (X);
- `model_class_overrides` (C5) with no plugin loaded for it, while the allow-list filters the model
  family's general plugin out, visibly, in every process (G2); in the same run an executor class
  (C7) configured through an `additional_config` key its plugin claims (C9);
- the same claim refusing a misspelt option and an unclaimed key, in the frontend, before spawning;
- the model family's register() called by the user's script instead of the entry point: the worker
  lacks the architecture and its manifest check names it (G1, X);
- a parser plugin value too short for vLLM to look at fails the server's start-up, naming it (G3).

Each plugin appends {"plugin", "event", "pid", "role"} lines to AE_PLUGIN_RECORD; the assertions compare
them with the processes of the start-up trace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

MODEL_DIST, EXECUTOR_DIST = "asyncengine-model-example", "asyncengine-executor-example"
MODEL_PLUGIN, EXECUTOR_PLUGIN = "ae_model_example", "ae_executor_example"
ARCHITECTURE = "ExampleLlamaForCausalLM"
TEXTS = ["hello world", "plugins everywhere", "caf\u00e9 au lait"]
NUM_TOKENS = 12

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_file, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
prompts = json.loads(sys.argv[4])
register_in_script = os.environ.get("AE_REGISTER_IN_SCRIPT") == "1"
if register_in_script:  # the plugin's own register(), called here instead of through its entry point
    import ae_model_example
    ae_model_example.register()
result = {"pid": os.getpid()}
try:
    settings = dict(in_process=False, distributed_executor_backend="mp", max_model_len=256,
                    kv_cache_memory_bytes=8 * 2**20, startup_trace=trace_file)
    with LLM(model, **{**settings, **options}) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=%(num_tokens)d, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
        result["prompt_ids"] = [list(output.prompt_token_ids) for output in outputs]
        result["model_class"] = [answer["model_class"] for answer in llm.collective_rpc("describe")]
except Exception as error:
    result.update(error=type(error).__name__, message=str(error), field=getattr(error, "field", None))
print(json.dumps(result))
""" % {"num_tokens": NUM_TOKENS}


def byte_ids(text: str) -> list[int]:
    """What the model family's tokenizer mode `example_bytes` gives: BOS (1), then each UTF-8 byte + 3."""
    return [1, *(byte + 3 for byte in text.encode("utf-8"))]


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """The tiny Llama (safetensors), and the model family's copy: its architecture, weights.npz only."""
    stock = tiny_model("llama").path
    family = tmp_path_factory.mktemp("example-family") / "model"
    shutil.copytree(stock, family)
    config = json.loads((family / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (family / "config.json").write_text(json.dumps(config, indent=2))
    convert = ("import sys; sys.path.insert(0, sys.argv[2]); from ae_model_example.loader import save_npz; "
               "save_npz(sys.argv[1])")
    source = Path(__file__).resolve().parents[2] / "plugins" / MODEL_DIST / "src"
    subprocess.run([sys.executable, "-c", convert, str(family), str(source)], check=True, timeout=120)
    for weights in family.glob("*.safetensors"):
        weights.unlink()  # only the family's own format is left: the safetensors loader could not load it
    return stock, family


@pytest.fixture(scope="module")
def stock_tokens(models):
    """Greedy tokens of the stock Llama on the byte ids of TEXTS, in-process, no plugin."""
    from asyncengine import LLM, SamplingParams

    stock, _ = models
    with LLM(str(stock), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": byte_ids(text)} for text in TEXTS], params)
        return [list(output.outputs[0].token_ids) for output in outputs]


def run(tmp_path: Path, env: dict[str, str], model: Path, name: str, options: dict, prompts: list) -> tuple:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / f"{name}-trace.json"
    completed = subprocess.run([sys.executable, str(script), str(model), str(trace_file), json.dumps(options),
                                json.dumps(prompts)], capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    trace = read_trace(trace_file) if trace_file.exists() else []
    return result, trace


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def where(records: list[dict], plugin: str, event: str) -> list[tuple[str, int]]:
    return sorted((r["role"], r["pid"]) for r in records if r["plugin"] == plugin and r["event"] == event)


def pids_by_role(trace) -> dict[str, int]:
    pids: dict[str, int] = {}
    for record in trace:
        if pids.setdefault(record.role, record.pid) != record.pid:
            raise AssertionError(f"two pids for {record.role}: {pids[record.role]} and {record.pid}")
    return pids


@pytest.mark.extension_point("E1", "R1", "R5", "R9", "X")
def test_a_model_family_from_one_general_plugin_runs_each_part_where_it_must(models, stock_tokens, tmp_path,
                                                                             plugin_env):
    _, family = models
    record_file = tmp_path / "records.jsonl"
    env = plugin_env(MODEL_DIST, AE_PLUGIN_RECORD=str(record_file))
    result, trace = run(tmp_path, env, family, "family", {"load_format": "example_npz",
                                                           "tokenizer_mode": "example_bytes"}, TEXTS)
    assert "error" not in result, result
    pids = pids_by_role(trace)
    assert set(pids) == {"frontend", "engine core", "worker rank 0"}
    assert pids["frontend"] == result["pid"] and len(set(pids.values())) == 3

    # The tokenizer (R9) turned the texts into the family's byte ids, in the frontend only; the model
    # (R1) was built and its weights.npz read (R5) in the worker only; the tokens are the stock Llama's.
    assert result["prompt_ids"] == [byte_ids(text) for text in TEXTS]
    assert result["tokens"] == stock_tokens
    records = read_records(record_file)
    assert where(records, MODEL_PLUGIN, "tokenizer built") == [("frontend", pids["frontend"])]
    assert where(records, MODEL_PLUGIN, "built") == [("worker rank 0", pids["worker rank 0"])]
    assert where(records, MODEL_PLUGIN, "weights loaded") == [("worker rank 0", pids["worker rank 0"])]
    assert result["model_class"] == [f"ae_model_example.model:{ARCHITECTURE}"]

    # E1: the general plugin ran in every process, in its phase; X: each child compared the registries
    # its role reads with the frontend's manifest and found them whole.
    loaded = {r.role for r in trace if r.plugin == MODEL_PLUGIN and r.group and r.outcome == "ok"}
    assert loaded == {"frontend", "engine core", "worker rank 0"}
    manifest = [record for record in trace if record.phase == "manifest check"]
    assert {record.role for record in manifest} == {"engine core", "worker rank 0"}
    assert all(record.outcome == "ok" for record in manifest), manifest
    compared = {record.plugin.removeprefix("registry:") for record in manifest
                if record.role == "worker rank 0" and (record.plugin or "").startswith("registry:")}
    assert {"models", "model_loaders"} <= compared, compared


@pytest.mark.extension_point("C5", "C7", "C9", "G2")
def test_class_override_and_executor_hook_with_the_model_plugin_filtered_out(models, stock_tokens, tmp_path,
                                                                            plugin_env):
    stock, _ = models
    record_file = tmp_path / "records.jsonl"
    env = plugin_env(MODEL_DIST, EXECUTOR_DIST, AE_PLUGIN_RECORD=str(record_file))
    options = {
        "skip_tokenizer_init": True,
        "plugins": EXECUTOR_PLUGIN,  # the allow-list: the model family's general plugin is filtered out
        "model_class_overrides": {"LlamaForCausalLM": f"ae_model_example.model:{ARCHITECTURE}"},
        "distributed_executor_backend": "ae_executor_example.executor:CountingExecutor",
        "additional_config": {"ae_example_executor": {"label": "rows"}},
    }
    prompts = [{"prompt_token_ids": byte_ids(text)} for text in TEXTS]
    result, trace = run(tmp_path, env, stock, "override", options, prompts)
    assert "error" not in result, result
    pids = pids_by_role(trace)
    assert set(pids) == {"frontend", "engine core", "worker rank 0"} and len(set(pids.values())) == 3
    assert result["tokens"] == stock_tokens

    # G2: the filtered plugin is in every process's report as skipped (not allowed), never silently gone.
    skipped = {r.role: r.reason for r in trace if r.plugin == MODEL_PLUGIN}
    assert skipped == dict.fromkeys(pids, "not allowed (--plugins does not name it)"), skipped
    assert all(r.outcome == "skipped" for r in trace if r.plugin == MODEL_PLUGIN)

    # C5: the class named by the override was built in the worker, with no plugin registering it.
    records = read_records(record_file)
    assert where(records, MODEL_PLUGIN, "built") == [("worker rank 0", pids["worker rank 0"])]
    assert result["model_class"] == [f"ae_model_example.model:{ARCHITECTURE}"]

    # C7 + C9: the engine core built the executor with the options of its claimed key, and it submitted
    # every step (at least one per generated token).
    built = [r for r in records if r["plugin"] == EXECUTOR_PLUGIN and r["event"] == "built"]
    assert [(r["role"], r["pid"], r["options"]) for r in built] == [
        ("engine core", pids["engine core"], {"label": "rows"})]
    (shut_down,) = [r for r in records if r["plugin"] == EXECUTOR_PLUGIN and r["event"] == "shut down"]
    assert (shut_down["role"], shut_down["pid"]) == ("engine core", pids["engine core"])
    assert shut_down["steps"] >= NUM_TOKENS and shut_down["label"] == "rows"
    claimed = [r for r in trace if r.phase == "config hooks" and "additional_config['ae_example_executor']"
               in (r.plugin or "")]
    assert [r.role for r in claimed] == ["frontend"] and "ae_executor_example" in claimed[0].plugin


@pytest.mark.extension_point("C9")
@pytest.mark.parametrize(("additional_config", "message"), [
    ({"ae_example_executor": {"lable": "x"}},
     r"additional_config\['ae_example_executor'\]=\{'lable': 'x'\} was refused by .*ae_executor_example.*"
     r"unknown option\(s\) \['lable'\]"),
    ({"ae_example_executr": {}},
     r"additional_config key 'ae_example_executr' is claimed by no platform or plugin; claimed keys: .*"
     r"'ae_example_executor'"),
])
def test_a_refused_or_unclaimed_key_fails_in_the_frontend_before_spawning(models, tmp_path, plugin_env,
                                                                        additional_config, message):
    stock, _ = models
    env = plugin_env(EXECUTOR_DIST)
    result, trace = run(tmp_path, env, stock, "refused", {"skip_tokenizer_init": True,
                                                          "additional_config": additional_config}, [[5, 6]])
    assert result.get("error") == "ConfigError", result
    assert result["message"].startswith(f"the frontend (pid {result['pid']}) failed in start-up phase "), result
    assert re.search(message, result["message"]), result["message"]
    assert {record.role for record in trace} <= {"frontend"}  # nothing was spawned


@pytest.mark.extension_point("G1", "X")
def test_registering_from_the_script_instead_of_the_entry_point_is_caught_in_the_worker(models, tmp_path,
                                                                                       plugin_env):
    _, family = models
    env = plugin_env(MODEL_DIST, AE_REGISTER_IN_SCRIPT="1")
    # The allow-list keeps the entry point from loading, as if the distribution were not installed as a
    # plugin: only the script's own call registers the family, in the frontend's process.
    result, trace = run(tmp_path, env, family, "script", {"plugins": "", "load_format": "example_npz",
                                                          "skip_tokenizer_init": True}, [[5, 6, 7]])
    assert result.get("error") == "MissingRegistration", result
    failed = [r for r in trace if r.phase == "manifest check" and r.outcome == "failed"]
    assert failed and {r.role for r in failed} == {"worker rank 0"}, failed
    worker_pid = failed[0].pid
    assert worker_pid != result["pid"]
    assert re.fullmatch(
        rf"the worker rank 0 \(pid {worker_pid}\) failed in start-up phase 'manifest check': (model architecture "
        rf"'{ARCHITECTURE}' is missing from registry 'models'|model loader 'example_npz' is missing from registry "
        rf"'model_loaders') here, while the frontend \(pid {result['pid']}\) has it \(registered there by the "
        r"calling script\): .*register it from a general plugin.*",
        result["message"],
    ), result["message"]


@pytest.mark.extension_point("G3")
@pytest.mark.parametrize("value", ["xyz"])
def test_a_short_parser_plugin_value_fails_the_server_start_naming_it(tiny_model, plugin_env, value):
    # vLLM skips a --tool-parser-plugin of three characters or fewer; here it is imported like any other
    # value (so a short real module, like the standard library's "abc", is imported too), and a module
    # that does not exist stops the server before it serves, naming the option.
    env = plugin_env("asyncengine-parsers-example")
    completed = subprocess.run(
        [sys.executable, "-m", "asyncengine", "serve", str(tiny_model("llama").path), "--skip-tokenizer-init",
         "--port", "0", "--tool-parser-plugin", value, "--enable-auto-tool-choice", "--tool-call-parser",
         "example_fn"],
        capture_output=True, text=True, env=env, timeout=60)
    assert completed.returncode != 0
    assert (f"--tool-parser-plugin {value!r}: importing it failed with ModuleNotFoundError: No module named "
            f"{value!r}; fix the plugin (or install what it imports) or drop the option") in completed.stderr
