"""Each way a plugin can go wrong, through `asyncengine plugins check` (a real start of every role,
without a model): the exit code and the exact report or error line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

GENERAL = "ae-plugin-general"


def test_list_shows_each_plugin_with_its_distribution_and_processes(cli, plugin_env):
    result = cli(["plugins", "list"], plugin_env(GENERAL))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "asyncengine.general_plugins  ae_general  [ae-plugin-general 1.2.0]  allowed  " \
           "loaded in: frontend, engine core, worker" in lines
    assert "asyncengine.logits_processors  ae_noop_logits  [ae-plugin-general 1.2.0]  allowed  " \
           "loaded in: frontend, worker" in lines
    assert any(line.startswith("asyncengine.endpoint_plugins  ae_hello") and "skipped: opt-in" in line for line in lines)


@pytest.mark.extension_point("G2")
def test_a_plugin_the_allow_list_filters_is_reported_as_skipped(cli, plugin_env):
    result = cli(["plugins", "check", "--plugins", "ae_stats"], plugin_env(GENERAL))
    assert result.returncode == 0, result.stderr
    assert re.search(r"skipped general plugins: asyncengine.general_plugins ae_general \[ae-plugin-general 1.2.0\] "
                     r"\(not allowed \(--plugins does not name it\)\)", result.stdout)
    assert re.search(r"ok      role groups: asyncengine.stat_logger_plugins ae_stats", result.stdout)


def test_the_environment_allow_list_and_an_empty_one(cli, plugin_env):
    result = cli(["plugins", "check"], plugin_env(GENERAL, ASYNCENGINE_PLUGINS=" ae_stats , "))
    assert "skipped general plugins: asyncengine.general_plugins ae_general" in result.stdout
    assert "(not allowed (ASYNCENGINE_PLUGINS does not name it))" in result.stdout
    result = cli(["plugins", "check"], plugin_env(GENERAL, ASYNCENGINE_PLUGINS=""))
    assert result.returncode == 0
    assert "ok      general plugins: " not in result.stdout


def test_an_unknown_allow_list_name_exits_2_listing_the_installed_names(cli, plugin_env):
    for args in (["plugins", "check", "--plugins", "ae_general,nope"], ["generate", "hi", "--plugins", "nope"]):
        result = cli(args, plugin_env(GENERAL))
        assert result.returncode == 2, result.stderr
        assert "names plugin(s) nope that are not installed; installed: ae_general " \
               "(asyncengine.general_plugins), ae_stats" in result.stderr


def test_an_endpoint_plugin_loads_only_when_named(cli, plugin_env):
    result = cli(["plugins", "check"], plugin_env(GENERAL))
    assert "skipped role groups: asyncengine.endpoint_plugins ae_hello [ae-plugin-general 1.2.0] (opt-in: " \
           "endpoint plugins load only when named in the allow-list (--plugins))" in result.stdout
    result = cli(["plugins", "check", "--plugins", "ae_hello"], plugin_env(GENERAL))
    assert result.returncode == 0
    assert "ok      role groups: asyncengine.endpoint_plugins ae_hello" in result.stdout


@pytest.mark.extension_point("E1")
@pytest.mark.parametrize("in_process", [False, True], ids=["engine core process", "in-process"])
def test_a_plugin_that_raises_on_import_fails_start_up_naming_itself(cli, plugin_env, in_process):
    args = ["plugins", "check"] + (["--in-process"] if in_process else [])
    result = cli(args, plugin_env("ae-plugin-import-error"))
    assert result.returncode == 1
    assert re.search(
        r"the frontend \(pid \d+\) failed in start-up phase 'general plugins': plugin 'ae_import_error' "
        r"\(asyncengine.general_plugins from ae-plugin-import-error 0.1.0\) failed to import: "
        r"ImportError: ae_plugin_import_error is broken on purpose", result.stderr), result.stderr
    assert "failed  general plugins: asyncengine.general_plugins ae_import_error" in result.stdout


def test_a_plugin_that_raises_when_called_fails_start_up_naming_itself(cli, plugin_env):
    result = cli(["plugins", "check"], plugin_env("ae-plugin-call-error"))
    assert result.returncode == 1
    assert re.search(
        r"the frontend \(pid \d+\) failed in start-up phase 'general plugins': plugin 'ae_call_error' "
        r"\(asyncengine.general_plugins from ae-plugin-call-error 0.1.0\) raised when called: "
        r"RuntimeError: ae_call_error fails when called, on purpose", result.stderr), result.stderr


def test_lenient_records_the_failure_and_goes_on(cli, plugin_env):
    result = cli(["plugins", "check", "--plugins-lenient"], plugin_env("ae-plugin-call-error", GENERAL))
    assert "failed  general plugins: asyncengine.general_plugins ae_call_error" in result.stdout
    assert "ok      general plugins: asyncengine.general_plugins ae_general" in result.stdout
    assert "engine core (pid" in result.stdout  # the start went on to the other processes
    assert result.returncode == 1  # check still reports the failure


def test_an_async_plugin_that_hangs_is_bounded_by_the_start_up_timeout(cli, plugin_env):
    result = cli(["plugins", "check", "--plugin-startup-timeout", "2"], plugin_env("ae-plugin-hang"), timeout=60)
    assert result.returncode == 1
    assert re.search(
        r"failed in start-up phase 'general plugins': plugin 'ae_hang' \(asyncengine.general_plugins from "
        r"ae-plugin-hang 0.1.0\) did not finish within 2 s \(plugin_startup_timeout\)", result.stderr), result.stderr


def test_a_raising_platform_detector_fails(cli, plugin_env):
    result = cli(["plugins", "check"], plugin_env("ae-plugin-platform-raise"))
    assert result.returncode == 1
    assert re.search(
        r"failed in start-up phase 'platform': plugin 'cpu_raise' \(asyncengine.platform_plugins from "
        r"ae-plugin-platform-raise 0.1.0\) raised when called: OSError: cannot probe the accelerator", result.stderr
    ), result.stderr


@pytest.mark.extension_point("E2")
def test_two_active_out_of_tree_platforms_fail_naming_both(cli, plugin_env):
    result = cli(["plugins", "check"], plugin_env("ae-plugin-platform-a", "ae-plugin-platform-b"))
    assert result.returncode == 1
    assert "two or more out-of-tree platforms are active: 'cpu_a' (ae_plugin_platform_a:CpuVariant) and " \
           "'cpu_b' (ae_plugin_platform_b:CpuVariant); choose one with --device NAME" in result.stderr
    chosen = cli(["plugins", "check", "--device", "cpu_b"], plugin_env("ae-plugin-platform-a", "ae-plugin-platform-b"))
    assert chosen.returncode == 0, chosen.stderr
    assert "ok      platform: chosen: cpu_b (named by --device)" in chosen.stdout
    assert "ok      platform: chosen: cpu_b (chosen by the frontend)" in chosen.stdout


@pytest.mark.extension_point("E2")
def test_one_active_out_of_tree_platform_wins_over_the_built_ins(cli, plugin_env):
    result = cli(["plugins", "check", "--tp", "2"], plugin_env("ae-plugin-platform-a"))
    assert result.returncode == 0, result.stderr
    assert "ok      platform: asyncengine.platform_plugins cpu_a [ae-plugin-platform-a 0.1.0] " \
           "(active: ae_plugin_platform_a:CpuVariant)" in result.stdout
    assert "skipped platform: detector:cuda (out-of-tree platform 'cpu_a' is active and wins over the built-ins)" \
        in result.stdout
    assert result.stdout.count("platform: chosen: cpu_a") == 4  # frontend, engine core, two workers


def test_an_async_general_plugin_runs_in_every_process(cli, plugin_env):
    result = cli(["plugins", "check", "--distributed-executor-backend", "mp"], plugin_env("ae-plugin-async"))
    assert result.returncode == 0, result.stderr
    ok = re.findall(r"^ +(\d+\.\d) ms  ok      general plugins: asyncengine.general_plugins ae_async "
                    r"\[ae-plugin-async 0.3.0\]$", result.stdout, re.MULTILINE)
    assert len(ok) == 3  # frontend, engine core, worker
    assert all(float(ms) >= 50 for ms in ok)  # its await ran to the end in each
    # The worker compared the models registry with the frontend's: the plugin's key is there too.
    assert "ok      manifest check: registry:models (same keys as the frontend)" in result.stdout


OWNER_SCRIPT = """
import sys, anyio
from asyncengine.config.engine import EngineConfig
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.plugin_runtime.phases import run_plugin_phases
from asyncengine.plugin_runtime.records import StartupTrace

anyio.run(run_plugin_phases, {"frontend"}, EngineConfig(), StartupTrace("frontend"), backend=sys.argv[1])
print(ModelRegistry.owners()["AsyncPluginLlamaForCausalLM"])
"""


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_what_an_async_plugin_registers_is_attributed_to_it(plugin_env, backend):
    result = subprocess.run([sys.executable, "-c", OWNER_SCRIPT, backend], env=plugin_env("ae-plugin-async"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "plugin 'ae_async' (ae-plugin-async)"
