"""`worker_cls` (EXTENSION_POINTS.md C2): "auto" (the platform sets it) or "pkg.mod:Class", a subclass
of the built-in Worker, checked in the config-hooks phase; the worker-extension check compares
against the configured worker class."""

from __future__ import annotations

import itertools
import sys

import pytest

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.interfaces.platform import Platform
from asyncengine.config.engine import BUILTIN_WORKER
from asyncengine.plugin_runtime.config_hooks import HOOKS, hooks_checked, load_hook
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER
from asyncengine.cli.reports.extension_map import CONFIG_HOOK, build_map
from asyncengine.worker.build import build_worker
from asyncengine.worker.worker import Worker

_names = itertools.count()

MODULE = '''
from asyncengine.plugins_api import Worker


class MyWorker(Worker):
    def my_method(self):
        return "mine"


class NotAWorker:
    pass


class ExtensionClashingWithMyWorker:
    def __init__(self, worker):
        self.worker = worker

    def my_method(self):
        return "never"
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = f"ae_test_worker_cls_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_auto_and_a_path_are_accepted_anything_else_is_not():
    assert EngineConfig().worker_cls == "auto"
    assert EngineConfig(worker_cls="pkg.mod:MyWorker").worker_cls == "pkg.mod:MyWorker"
    for bad in ("", "no_colon", "pkg.mod:", ":Class"):
        with pytest.raises(ConfigError) as info:
            EngineConfig(worker_cls=bad)
        assert info.value.field == "worker_cls" and "pkg.mod:Class" in str(info.value)


def test_the_built_in_platforms_set_auto_to_the_built_in_worker():
    assert BUILTIN_WORKER == "asyncengine.worker.worker:Worker"
    assert CpuPlatform.check_and_update_config(EngineConfig()).worker_cls == BUILTIN_WORKER
    assert Platform.check_and_update_config(EngineConfig(worker_cls="a.b:C")).worker_cls == "a.b:C"  # left alone
    assert type(build_worker(EngineConfig(), None, CpuPlatform)) is Worker
    assert type(build_worker(EngineConfig(worker_cls=BUILTIN_WORKER), None, CpuPlatform)) is Worker


def test_a_worker_class_must_subclass_the_built_in_worker(module):
    assert load_hook("worker_cls", f"{module}:MyWorker").__name__ == "MyWorker"
    with pytest.raises(ConfigError) as info:
        load_hook("worker_cls", f"{module}:NotAWorker")
    assert info.value.field == "worker_cls"
    assert str(info.value) == (
        f"worker_cls: {module}:NotAWorker is not a subclass of asyncengine.worker.worker:Worker; subclass "
        "asyncengine.plugins_api.Worker (the worker interface: each worker builds it with Worker's arguments and "
        "the engine core calls its methods by name)")
    assert "is 3, not a class" in HOOKS["worker_cls"].check(3)


def test_the_worker_reads_it_and_the_frontend_checks_it():
    config = EngineConfig(worker_cls="pkg.mod:MyWorker")
    assert HOOKS["worker_cls"].readers == (WORKER,)
    assert hooks_checked(config, {FRONTEND}) == [("worker_cls", "pkg.mod:MyWorker")]
    assert hooks_checked(config, {WORKER}) == [("worker_cls", "pkg.mod:MyWorker")]
    assert hooks_checked(config, {ENGINE_CORE}) == []
    # "auto" and the built-in worker (what the built-in platforms set) are not hooks to check
    assert hooks_checked(EngineConfig(), {FRONTEND}) == []
    assert hooks_checked(EngineConfig(worker_cls=BUILTIN_WORKER), {WORKER}) == []


def test_the_extension_check_compares_against_the_configured_worker_class(module):
    extension = f"{module}:ExtensionClashingWithMyWorker"
    assert load_hook("worker_extension_cls", extension, config=EngineConfig()).__name__.startswith("Extension")
    with pytest.raises(ConfigError) as info:
        load_hook("worker_extension_cls", extension, config=EngineConfig(worker_cls=f"{module}:MyWorker"))
    assert info.value.field == "worker_extension_cls"
    assert (f"defines public method 'my_method', which the worker class {module}:MyWorker already has"
            in str(info.value))


def test_build_worker_builds_the_configured_class(module):
    config = EngineConfig(worker_cls=f"{module}:MyWorker")
    worker = build_worker(config, None, CpuPlatform)
    assert type(worker).__name__ == "MyWorker" and worker.my_method() == "mine" and worker.rank == 0
    assert type(build_worker(EngineConfig(), None, CpuPlatform, rank=0, world_size=1)) is Worker


def test_the_map_shows_the_worker_building_it():
    locations = [entry.location for entry in build_map() if entry.kind == CONFIG_HOOK and entry.name == "worker_cls"]
    assert len(locations) == 1 and locations[0].startswith("asyncengine/worker/build.py:")
