"""KV connectors (EXTENSION_POINTS.md R6, C6) end to end, in real multiprocess servers (`asyncengine serve`
with `--distributed-executor-backend mp`: the frontend, the engine core and each worker are processes of
their own).

For each connector, a producer server runs a prompt of several blocks and saves its KV; a second, fresh
server (the consumer) runs the same prompt: /metrics shows that its prefill computed only the tokens after
the loaded prefix (computed == prompt length - loaded, loaded > 0), and the greedy output is the same.

- the built-in LocalDiskConnector (registered in code), chosen by name from the registry, with two
  tensor-parallel ranks (each saves and loads its own shard);
- asyncengine-kv-connector-example, installed as a real distribution: its general plugin registers
  ExampleDiskConnector; the producer picks it from the registry, the consumer names the plugin's other
  module with kv_connector_module_path (C6), which wins over the registry entry, and the start-up report
  of the engine core and of the worker says so. The plugin's records name the process each half ran in:
  the scheduler side in the engine core, the worker side in the worker.

Each server start costs seconds (each of its processes imports torch), so the two producers start together,
then the two consumers (a module fixture); the tests then check what each pair did.
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from support.server import metric, start_server

TINY_OPTIONS = ["--skip-tokenizer-init", "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 * 2**20),
                "--distributed-executor-backend", "mp"]
BLOCK_SIZE = 16  # the default block size
PROMPT = [5 + (7 * i) % 90 for i in range(70)]  # 4 full blocks and 6 tokens
# The consumer loads every full block that ends before the last prompt token.
LOADED = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
DIST, PLUGIN, CONNECTOR = "asyncengine-kv-connector-example", "ae_kv_connector_example", "ExampleDiskConnector"
MODULE_PATH = f"{PLUGIN}.via_module_path"  # the plugin's module for kv_connector_module_path (C6)


def serve_once(model: Path, kv_transfer_config: dict, env: dict, tp: int = 1) -> dict:
    """Start a server, complete PROMPT greedily, read the metrics and the start-up report, stop it."""
    server = start_server([str(model), *TINY_OPTIONS, "--tensor-parallel-size", str(tp),
                           "--kv-transfer-config", json.dumps(kv_transfer_config)], env=env)
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            # Without a tokenizer the server names each token "token_id:N" in the logprobs.
            completion = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0,
                                                   logprobs=1, extra_body={"ignore_eos": True})
        with urllib.request.urlopen(server.base_url + "/startup") as response:
            startup = json.loads(response.read())
        result = {
            "tokens": completion.choices[0].logprobs.tokens,
            "prompt_tokens": completion.usage.prompt_tokens,
            "computed": metric(server, "prompt_tokens_computed_total"),
            "loaded": metric(server, "kv_connector_loaded_tokens_total"),
            "prompt_total": metric(server, "prompt_tokens_total"),
            "pids": {record["role"]: record["pid"] for record in startup},
            "connector": {record["role"]: record["reason"] for record in startup if record["plugin"] == "kv connector"},
            "server_pid": server.process.pid,
            "tp": tp,
        }
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
    return result


def check_pair(producer: dict, consumer: dict) -> None:
    for run in (producer, consumer):
        assert run["prompt_tokens"] == len(PROMPT) == run["prompt_total"]
        # Processes of their own: the frontend (the server), the engine core and a worker per rank.
        workers = {f"worker rank {rank}" for rank in range(run["tp"])}
        assert set(run["pids"]) == {"frontend", "engine core"} | workers
        assert len(set(run["pids"].values())) == 2 + run["tp"] and run["pids"]["frontend"] == run["server_pid"]
        # The connector is in the report of each process that runs a side of it, and only there.
        assert set(run["connector"]) == {"engine core"} | workers, run["connector"]
    assert (producer["computed"], producer["loaded"]) == (len(PROMPT), 0)
    assert consumer["loaded"] == LOADED > 0
    assert consumer["computed"] == len(PROMPT) - consumer["loaded"]
    assert consumer["tokens"] == producer["tokens"] and len(producer["tokens"]) == 8
    assert all(token.startswith("token_id:") for token in producer["tokens"])


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory, plugin_target):
    """Both pairs: the built-in connector's and the plugin's, producers first, then consumers."""
    model = tiny_model("llama").path
    root = tmp_path_factory.mktemp("kv-connector")
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
    plugin_env = {**env, "PYTHONPATH": str(plugin_target(DIST))}
    built_in = {"kv_connector": "LocalDiskConnector", "kv_connector_extra_config": {"path": str(root / "built-in")}}
    plugin = {"kv_connector": CONNECTOR, "kv_connector_extra_config": {"path": str(root / "plugin")}}
    files = {side: root / f"{side}.jsonl" for side in ("producer", "consumer")}
    with ThreadPoolExecutor(2) as pool:
        # The built-in pair with two tensor-parallel ranks: each saves and loads its own shard.
        producers = [pool.submit(serve_once, model, {**built_in, "kv_role": "producer"}, env, 2),
                     pool.submit(serve_once, model, {**plugin, "kv_role": "producer"},
                                 {**plugin_env, "AE_PLUGIN_RECORD": str(files["producer"])})]
        producers = [future.result() for future in producers]
        saved = {"built-in": sorted(path.name for path in (root / "built-in").iterdir()),
                 "plugin": sorted(str(path.relative_to(root / "plugin")) for path in (root / "plugin").rglob("*")
                                  if path.is_file())}
        consumers = [pool.submit(serve_once, model, {**built_in, "kv_role": "consumer"}, env, 2),
                     pool.submit(serve_once, model, {**plugin, "kv_role": "consumer",
                                                     "kv_connector_module_path": MODULE_PATH},
                                 {**plugin_env, "AE_PLUGIN_RECORD": str(files["consumer"])})]
        consumers = [future.result() for future in consumers]
    return {"built-in": (producers[0], consumers[0]), "plugin": (producers[1], consumers[1]), "saved": saved,
            "root": root, "records": {side: read_records(path) for side, path in files.items()}}


@pytest.mark.extension_point("R6")
def test_the_built_in_local_disk_connector_saves_then_supplies_the_prefix(runs):
    producer, consumer = runs["built-in"]
    saved = runs["saved"]["built-in"]
    keys = {name.split(".")[0] for name in saved if name.endswith(".safetensors")}
    assert len(keys) == len(PROMPT) // BLOCK_SIZE, saved  # the prompt's full blocks, one shard per rank
    assert saved == sorted([f"{key}.tp2-rank{rank}.safetensors" for key in keys for rank in (0, 1)]
                           + ["identity.tp2-rank0.json", "identity.tp2-rank1.json"])
    check_pair(producer, consumer)
    for side in ("engine core", "worker rank 0", "worker rank 1"):
        reason = consumer["connector"][side]
        assert reason.startswith("LocalDiskConnector = asyncengine.kv_transfer.local_disk:LocalDiskConnector ("), reason
        assert "kv_role consumer" in reason
        assert "from the registry entry 'LocalDiskConnector', registered by built-in" in reason
    assert "(scheduler side, kv_role consumer)" in consumer["connector"]["engine core"]
    assert "(worker side, rank 0, kv_role consumer)" in consumer["connector"]["worker rank 0"]
    assert "(worker side, rank 1, kv_role consumer)" in consumer["connector"]["worker rank 1"]
    # Nothing new saved by the consumer.
    assert sorted(path.name for path in (runs["root"] / "built-in").iterdir()) == saved


@pytest.mark.extension_point("R6", "C6")
def test_a_plugin_connector_from_the_registry_and_by_module_path(runs):
    producer, consumer = runs["plugin"]
    # The plugin's own layout: a fan-out by the key's first two hex digits.
    blocks = [Path(name) for name in runs["saved"]["plugin"] if name.endswith(".rank0-of-1.safetensors")]
    assert len(blocks) == len(PROMPT) // BLOCK_SIZE and all(b.parent.name == b.name[:2] for b in blocks), blocks
    assert "example-blocks/identity.rank0-of-1.json" in runs["saved"]["plugin"]
    check_pair(producer, consumer)

    # C6: the module path wins over the plugin's registry entry of the same name, and the report says so.
    registered = f"{PLUGIN}.connector:{CONNECTOR}"
    for side in ("engine core", "worker rank 0"):
        assert f"from the registry entry {CONNECTOR!r}, registered by " in producer["connector"][side]
        assert producer["connector"][side].startswith(f"{CONNECTOR} = {registered} (")
        reason = consumer["connector"][side]
        assert reason.startswith(f"{CONNECTOR} = {MODULE_PATH}:{CONNECTOR} ("), reason
        assert (f"from the kv_connector_module_path {MODULE_PATH!r}; it wins over the registry entry {CONNECTOR!r} "
                f"({registered}, registered by ") in reason, reason

    # Where each half ran: the scheduler side in the engine core, the worker side in the worker process.
    scheduler_events = {"get_num_new_matched_tokens", "build_connector_meta", "request_finished"}
    for run, side, variant, worker_event, extra_scheduler_event in (
            (producer, "producer", "registry", "wait_for_save", None),
            (consumer, "consumer", "module path", "start_load_kv", "update_state_after_alloc")):
        records = runs["records"][side]
        engine_core = (run["pids"]["engine core"], "engine core")
        worker = (run["pids"]["worker rank 0"], "worker rank 0")
        seen = {(r["event"], r["side"]): (r["pid"], r["role"]) for r in records}
        assert {r["variant"] for r in records} == {variant}
        assert seen[("init", "scheduler")] == engine_core and seen[("init", "worker")] == worker
        for event in scheduler_events | ({extra_scheduler_event} if extra_scheduler_event else set()):
            assert seen[(event, "scheduler")] == engine_core, (event, records)
        for event in ("register_kv_caches", worker_event):
            assert seen[(event, "worker")] == worker, (event, records)
        # The plugin's general plugin ran in every process, but its connector only in those two.
        assert {r["pid"] for r in records} == {engine_core[0], worker[0]}
    consumer_loads = [r for r in runs["records"]["consumer"] if r["event"] == "start_load_kv"]
    assert consumer_loads[0]["blocks"] == LOADED // BLOCK_SIZE
    assert not any(r["event"] == "wait_for_save" for r in runs["records"]["consumer"])
