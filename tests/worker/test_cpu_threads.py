"""The model's CPU threads (worker/cpu_threads.py, `cpu_threads` / `--cpu-threads`): how many, which CPUs,
and that the process's other threads are moved off the model's CPUs while an engine runs and put back after."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
from asyncengine.errors import ConfigError
from asyncengine.worker import cpu_threads
from asyncengine.worker.cpu_threads import ThreadPlan, plan_threads

CPUS = list(range(8))
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")


def test_the_default_pins_nothing_and_takes_the_cpus_shared_among_workers_at_most_torchs_count():
    assert plan_threads(None, 0, 1, CPUS, torch_default_threads=8) == ThreadPlan(8, None, None)
    assert plan_threads(None, 0, 1, CPUS, torch_default_threads=4) == ThreadPlan(4, None, None)  # SMT siblings
    assert plan_threads(None, 1, 2, CPUS, torch_default_threads=8) == ThreadPlan(4, None, None)


def test_fewer_threads_than_cpus_pin_each_rank_to_its_own_cpus_and_the_rest_to_other_work():
    assert plan_threads(3, 0, 1, CPUS, 8) == ThreadPlan(3, (0, 1, 2), (3, 4, 5, 6, 7))
    assert plan_threads(3, 1, 2, CPUS, 8) == ThreadPlan(3, (3, 4, 5), (6, 7))
    assert plan_threads(3, 0, 1, [2, 5, 6, 9], 8).describe() == \
        "3 model threads pinned to CPUs 2,5-6; the process's other threads on CPUs 9"


def test_data_parallel_engine_cores_of_one_host_share_its_cpus():
    from asyncengine.worker.cpu_threads import local_workers

    assert local_workers(0, 1, 0, 1, None) == (0, 1)
    # DP=2 of TP=2 on one host: four workers, engine core 1's ranks are the third and fourth
    assert [local_workers(rank, 2, dp, 2, "mp") for dp in (0, 1) for rank in (0, 1)] == [(0, 4), (1, 4), (2, 4),
                                                                                          (3, 4)]
    assert local_workers(1, 2, 1, 2, "ray") == (1, 2)  # Ray places ranks over nodes: only the engine's own
    index, sharing = local_workers(0, 1, 1, 2, None)  # DP=2, TP=1: each engine core's worker takes half
    assert plan_threads(None, index, sharing, CPUS, 8) == ThreadPlan(4, None, None)
    assert plan_threads(2, index, sharing, CPUS, 8) == ThreadPlan(2, (2, 3), (4, 5, 6, 7))  # not engine 0's CPUs


def test_data_parallel_rank_is_checked():
    from asyncengine import EngineConfig

    with pytest.raises(ConfigError, match="data_parallel_rank must be in"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)


def test_as_many_threads_as_cpus_or_more_pin_nothing():
    assert plan_threads(8, 0, 1, CPUS, 8) == ThreadPlan(8, None, None)
    assert plan_threads(4, 0, 4, CPUS, 8) == ThreadPlan(4, None, None)  # 16 threads on 8 CPUs: warned, not pinned


def test_cpu_threads_is_a_flag_and_is_checked():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--cpu-threads", "3"]), model=None).cpu_threads == 3
    with pytest.raises(ConfigError, match="cpu_threads must be at least 1") as info:
        engine_config_from_args(parser.parse_args(["--cpu-threads", "0"]), model=None)
    assert info.value.field == "cpu_threads"


@needs_two_cpus
def test_apply_pins_the_worker_thread_and_moves_the_others_then_restore_puts_them_back():
    cpus = sorted(os.sched_getaffinity(0))
    plan = ThreadPlan(1, (cpus[0],), tuple(cpus[1:]))
    release = threading.Event()
    bystander_id: list[int] = []

    def bystander() -> None:  # stands for the event loop's thread
        bystander_id.append(threading.get_native_id())
        release.wait(60)

    other = threading.Thread(target=bystander)
    other.start()
    seen: dict = {}

    def worker() -> None:
        applied = cpu_threads.apply(plan)
        seen["worker"] = os.sched_getaffinity(0)
        seen["threads"] = torch.get_num_threads()
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
        child.start()  # like the OpenMP threads the worker starts: they inherit its mask
        child.join()
        seen["bystander"] = os.sched_getaffinity(bystander_id[0])
        seen["main"] = os.sched_getaffinity(os.getpid())
        cpu_threads.restore(applied)
        seen["bystander after"] = os.sched_getaffinity(bystander_id[0])
        seen["main after"] = os.sched_getaffinity(os.getpid())

    before = torch.get_num_threads()
    try:
        runner = threading.Thread(target=worker)
        runner.start()
        runner.join(60)
    finally:
        release.set()
        other.join(60)
    assert seen["worker"] == seen["child"] == {cpus[0]}
    assert seen["threads"] == 1
    assert seen["bystander"] == seen["main"] == set(cpus[1:])
    assert seen["bystander after"] == seen["main after"] == set(cpus)
    assert torch.get_num_threads() == before


@needs_two_cpus
def test_an_engine_with_fewer_threads_than_cpus_runs_pinned_and_leaves_the_process_as_it_was(tiny_model):
    from asyncengine import LLM, SamplingParams

    cpus = sorted(os.sched_getaffinity(0))
    with LLM(str(tiny_model("llama").path), cpu_threads=1, dtype="float32", skip_tokenizer_init=True,
             max_model_len=128, kv_cache_memory_bytes=2**20, plugins="") as llm:
        described = llm.collective_rpc("describe")[0]["cpu_threads"]
        main_while_running = os.sched_getaffinity(0)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert described["threads"] == 1 and described["cpus"] == [cpus[0]]
    assert main_while_running == set(cpus[1:])
    assert os.sched_getaffinity(0) == set(cpus)


def test_the_default_leaves_cpus_other_processes_keep_busy():
    two = [0, 1]
    assert plan_threads(None, 0, 1, two, 2, busy=1.0) == ThreadPlan(1, None, None, 1.0)  # one core taken: one thread
    assert plan_threads(None, 0, 1, two, 2, busy=0.3) == ThreadPlan(2, None, None, 0.3)  # mostly free: both
    assert plan_threads(None, 0, 1, two, 2, busy=2.0).threads == 1  # never fewer than one
    assert plan_threads(None, 0, 2, CPUS, 8, busy=4.0).threads == 2  # the free half, shared by two workers
    assert plan_threads(2, 0, 1, two, 2, busy=2.0).threads == 2  # a given count is kept
    assert "1.0 CPUs busy with other processes" in plan_threads(None, 0, 1, two, 2, busy=1.0).describe()


@needs_two_cpus
def test_busy_cpus_sees_a_busy_loop():
    import subprocess
    import sys

    from asyncengine.worker.cpu_threads import busy_cpus

    cpus = sorted(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\n"
                             "while True: pass"])
    try:
        time.sleep(0.3)
        assert 0.5 <= busy_cpus(cpus) <= len(cpus)
    finally:
        loop.kill()
        loop.wait()
