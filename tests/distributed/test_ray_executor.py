"""The Ray executor on a local two-node Ray cluster (ray.cluster_utils.Cluster on this machine, two
logical CPUs per node: a TP=2 engine placed STRICT_SPREAD has one rank on each, a TP=2 x PP=2 engine
placed SPREAD two on each).

These tests run in the default suite (`-m "not ray"` leaves them out). Ray is heavy and only they need
it: they install it once into a target directory keyed by its version under pip's cache (never into
.venv; a fresh clone needs only PyPI), and put it on the path of this process (after the virtualenv's
packages) and of the Ray nodes. One cluster for the module: the head node has the test plugin
distribution ae-plugin-general on its path, the second node does not. The first test needs no cluster:
it checks that our actor calls take only str and bytes.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from asyncengine import EngineDeadError, SamplingParams
from support.hf_reference import compare_greedy, hf_greedy

# The first test on the cluster installs ray (fresh machine) and starts the cluster: 300 s is too tight.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

RAY_VERSION = "2.60.0"
OPTIONS = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
NUM_TOKENS = 12


# -- what crosses to Ray: str or bytes only (no cluster) ------------------------------------------------


class RecordingMethod:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return "ref"


def test_actor_calls_take_only_str_or_bytes():
    from asyncengine.engine_core import ray_executor

    method = RecordingMethod()
    assert ray_executor.invoke(method, "tcp:127.0.0.1:5", b"frame") == "ref"
    for bad in (3, {"rank": 0}, ["x"], None):
        with pytest.raises(TypeError, match="only str or bytes travel through Ray"):
            ray_executor.invoke(method, "ok", bad)
    assert method.calls == [("tcp:127.0.0.1:5", b"frame")]
    # Every actor method call in the module goes through invoke: the only other `.remote(` is the
    # actor's construction, which takes no argument (its options are Ray's own scheduling values), and
    # `ray.remote(RankActor)` makes the class an actor class.
    source = inspect.getsource(ray_executor)
    calls = [line.strip() for line in source.splitlines()
             if ".remote(" in line and "ray.remote(" not in line and not line.strip().startswith('"""')]
    assert calls == ["return method.remote(*args)", ").remote())"], calls
    # And what the module hands to invoke: rank numbers as strings, the listener's address and secret.
    assert "invoke(actor.launch, address, secret, str(rank))" in source


class FakeRay:
    def __init__(self) -> None:
        self.initialized = False
        self.events: list[str] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address=None, log_to_driver=True) -> None:
        self.initialized = True
        self.events.append(f"init {address}")

    def shutdown(self) -> None:
        self.initialized = False
        self.events.append("shutdown")


def test_engine_cores_of_one_process_share_its_ray_connection(monkeypatch):
    """Data parallelism in one process: the first engine core joins (RAY_ADDRESS) or starts Ray, the last
    to stop shuts it down, and never one the application connected itself."""
    from asyncengine.engine_core.ray_executor import _RayConnection

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    _RayConnection.acquire()
    _RayConnection.acquire()
    _RayConnection.release()
    assert fake.events == ["init 10.0.0.7:6379"]  # the other engine core still uses it
    _RayConnection.release()
    assert fake.events == ["init 10.0.0.7:6379", "shutdown"]
    fake.initialized, fake.events = True, []  # the application's own ray.init
    _RayConnection.acquire()
    _RayConnection.release()
    assert fake.events == [] and _RayConnection.users == 0


# -- the cluster --------------------------------------------------------------------------------------


INSTALL_TIMEOUT = 600  # seconds for `pip install ray` on a fresh machine (about 40 s with PyPI reachable)


def ray_target() -> Path:
    """ray installed (once per version) into a target under pip's cache: never into .venv. Concurrent
    runs take a lock, and a half-finished install (killed) is redone from scratch."""
    import fcntl

    found = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    # (With pip's cache disabled, PIP_NO_CACHE_DIR, the system's temporary directory keeps it instead.)
    cache = Path(found.stdout.strip()) if found.returncode == 0 and found.stdout.strip() else Path(
        tempfile.gettempdir())
    target = cache / "asyncengine-test-targets" / f"ray-{RAY_VERSION}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"ray-{RAY_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "ray" / "__init__.py").is_file():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            started = time.monotonic()
            try:
                subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial),
                                f"ray=={RAY_VERSION}"], check=True, timeout=INSTALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"pip install ray=={RAY_VERSION} took over {INSTALL_TIMEOUT} s: is PyPI reachable? "
                            "(-m 'not ray' leaves these tests out)")
            partial.rename(target)
            print(f"ray {RAY_VERSION} installed into {target} in {time.monotonic() - started:.0f} s")
    return target


@pytest.fixture(scope="module")
def cluster(plugin_target):
    target = str(ray_target())
    sys.path.append(target)  # after the virtualenv's own packages: ray's dependencies do not shadow them
    saved = dict(os.environ)  # ours, and whatever Ray sets: all put back after the module
    import ray
    from ray.cluster_utils import Cluster

    base = [p for p in (os.environ.get("PYTHONPATH") or "").split(os.pathsep) if p]
    plugin = str(plugin_target("ae-plugin-general"))
    os.environ["PYTHONPATH"] = os.pathsep.join([*base, target])
    os.environ["ASYNCENGINE_RAY_PLACEMENT_STRATEGY"] = "STRICT_SPREAD"  # one rank per node (TP=2 x PP=2: SPREAD)
    os.environ["ASYNCENGINE_RAY_PLACEMENT_TIMEOUT"] = "60"
    # (Ray binds the machine's own address, not loopback: a driver given 127.0.0.1 looks for the node
    # under the machine's address and never finds it. Nothing leaves the machine either way.)
    node = dict(num_cpus=2, object_store_memory=80 * 2**20)
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        **node, "include_dashboard": False, "env_vars": {"PYTHONPATH": os.pathsep.join([*base, target, plugin])}})
    try:  # (a second node that does not come up still stops the head)
        without_plugin = cluster.add_node(**node, env_vars={"PYTHONPATH": os.pathsep.join([*base, target])})
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False)
        print(f"ray cluster of 2 nodes up in {time.monotonic() - started:.1f} s")
        yield cluster, without_plugin.node_id, plugin, target
    finally:
        ray.shutdown()
        cluster.shutdown()
        # (ray put its own thirdparty_files, under the target, first on the path when imported: out too)
        sys.path[:] = [entry for entry in sys.path if not entry.startswith(target)]
        os.environ.clear()
        os.environ.update(saved)


def all_released() -> None:
    """No placement group left, and every CPU free again (no actor of ours holds one)."""
    import ray

    deadline = time.monotonic() + 30
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        cpus = ray.available_resources().get("CPU", 0)
        if not groups and cpus == ray.cluster_resources().get("CPU"):
            return
        assert time.monotonic() < deadline, (groups, ray.available_resources())
        time.sleep(0.2)


def generate_and_compare(llm, model, parity_record, ranks: list[int]) -> None:
    """Greedy outputs of two prompts against transformers' (compare_greedy's tie rule, as TP=1's parity
    tests); the engine is closed, every Ray resource released and every worker process gone."""
    prompts = [[5, 6, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    described = llm.collective_rpc("describe")
    assert [d["rank"] for d in described] == ranks
    assert os.getpid() not in {d["pid"] for d in described}
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm.close()
    all_released()
    for prompt, output in zip(prompts, outputs):
        comparison = compare_greedy(output.token_ids, output.logprobs, hf_greedy(model.hf_model, prompt, NUM_TOKENS))
        parity_record["sequences"] += 1
        parity_record["tokens"] += comparison.num_compared
        assert comparison.max_logprob_error < 1e-3, comparison
    for pid in (d["pid"] for d in described):
        assert not Path(f"/proc/{pid}").exists(), f"worker process {pid} outlived the engine"


def placement_nodes() -> list[str]:
    """The node id of each bundle of the one placement group there is."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1, groups
    return list(groups[0]["bundles_to_node_id"].values())


def bundles_per_node() -> list[int]:
    nodes = placement_nodes()
    return sorted(nodes.count(node) for node in set(nodes))


def test_tp2_one_rank_per_node_matches_tp1(cluster, tiny_model, make_llm, parity_record, tmp_path):
    from asyncengine.plugin_runtime.records import format_report, read_trace

    model = tiny_model("llama")
    llm = make_llm(str(model.path), tensor_parallel_size=2, distributed_executor_backend="ray",
                   startup_trace=str(tmp_path / "trace.json"), **OPTIONS)
    assert bundles_per_node() == [1, 1]  # one rank on each node
    nodes = sorted(set(placement_nodes()))
    generate_and_compare(llm, model, parity_record, [0, 1])
    # The start-up report has every rank's phases (manifest check included), each with its node.
    records = read_trace(tmp_path / "trace.json")
    where = {(r.role, r.node) for r in records if r.role.startswith("worker rank")}
    assert len(where) == 2 and sorted(node.split()[-1] for _, node in where) == nodes, where
    assert {r.role for r in records if r.phase == "manifest check"} >= {"worker rank 0", "worker rank 1"}
    report = format_report(records)
    for role, node in where:
        assert re.search(rf"^{role} \(pid \d+ on {re.escape(node)}\)$", report, re.M), report


def test_tp2_pp2_over_two_nodes_matches_tp1(cluster, tiny_model, make_llm, parity_record, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_RAY_PLACEMENT_STRATEGY", "SPREAD")  # 4 ranks, 2 nodes
    monkeypatch.setenv("ASYNCENGINE_PIPELINE_MICRO_BATCHES", "1")  # (the default; set in case the caller's is 0)
    model = tiny_model("llama")
    llm = make_llm(str(model.path), tensor_parallel_size=2, pipeline_parallel_size=2,
                   distributed_executor_backend="ray", **OPTIONS)
    assert bundles_per_node() == [2, 2]
    generate_and_compare(llm, model, parity_record, [0, 1, 2, 3])


def test_dp2_engine_cores_each_place_tp2_over_both_nodes(cluster, tiny_model, make_llm, parity_record):
    """Data parallelism through Ray: each engine core (here both in this process) places its own ranks."""
    import ray

    model = tiny_model("llama")
    llm = make_llm(str(model.path), data_parallel_size=2, tensor_parallel_size=2, in_process=True,
                   distributed_executor_backend="ray", **OPTIONS)
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 2, groups  # one per engine core, each with one rank on each node
    assert all(len(set(g["bundles_to_node_id"].values())) == 2 for g in groups), groups
    generate_and_compare(llm, model, parity_record, [0, 1, 0, 1])  # engine 0's ranks, then engine 1's


def test_killing_a_worker_actor_fails_every_caller_within_5_s(cluster, tiny_model):
    import ray

    from asyncengine import AsyncEngine

    model = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> tuple[list[float], list[str]]:
        failed_after: list[float] = []
        messages: list[str] = []
        async with AsyncEngine.start(model=str(model.path), tensor_parallel_size=2,
                                     distributed_executor_backend="ray", **OPTIONS) as engine:
            running = anyio.Event()
            killed_at = [0.0]

            async def one(start: int) -> None:
                try:
                    async for _ in engine.generate({"prompt_token_ids": list(range(start, start + 8))}, params):
                        running.set()
                except EngineDeadError as error:
                    failed_after.append(time.monotonic() - killed_at[0])
                    messages.append(str(error))

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for index in range(4):
                        tg.start_soon(one, 10 + index)
                    await running.wait()
                    names = [n for n in ray.util.list_named_actors() if n.endswith(":rank1")]
                    assert len(names) == 1, ray.util.list_named_actors()
                    killed_at[0] = time.monotonic()
                    ray.kill(ray.get_actor(names[0]), no_restart=True)
        return failed_after, messages

    failed_after, messages = anyio.run(main, backend="trio")
    assert len(failed_after) == 4, messages
    assert max(failed_after) < 5.0, failed_after
    assert all(re.search(r"worker rank 1 \(pid \d+ on Ray node [\d.]+ \w+\)", m) for m in messages), messages
    all_released()


SCRIPT = r"""
import json, sys
from asyncengine import LLM
from asyncengine.errors import StartupError
try:
    # In-process: the engine core hands the frontend's manifest to the Ray workers itself (core_client.py).
    LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", in_process=True,
        skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20).close()
except StartupError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"error": None}))
"""


def test_a_plugin_missing_on_one_node_fails_start_up_naming_it(cluster, tiny_model, tmp_path):
    _, node_without_plugin, plugin, target = cluster
    directory = tmp_path / "plugin-llama"
    shutil.copytree(tiny_model("llama").path, directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["PluginLlamaForCausalLM"]  # registered by ae-plugin-general
    (directory / "config.json").write_text(json.dumps(config))
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "ASYNCENGINE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([plugin, os.environ["PYTHONPATH"]])  # the frontend has the plugin
    env["RAY_ADDRESS"] = cluster[0].address
    result = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(directory)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    assert error is not None, "start-up succeeded with the plugin missing on one node"
    assert "'PluginLlamaForCausalLM' is missing from registry 'models'" in error, error
    assert node_without_plugin in error, error
    all_released()
