"""vLLM's loaders that its plugin tests call (plugins_api), without an engine or a server:
`load_stat_logger_plugin_factories()` (the allowed stat-logger classes; a TypeError naming a plugin whose
entry point is no StatLoggerBase subclass, as vLLM's test of an invalid plugin expects) and
`load_endpoint_plugins(supported_tasks)` (opt-in, gated by required_tasks as vLLM's is); and
`isinstance(obj, EndpointPlugin)` for vLLM's plain-class form, as vLLM's protocol check. The installed
plugins are stood in for here; real distributions: tests/e2e/test_vllm_shaped_stat_logger.py and
tests/e2e/test_vllm_shaped_endpoint.py."""

from __future__ import annotations

from importlib import metadata

import pytest

from asyncengine.plugin_runtime import discovery
from asyncengine.plugin_runtime import groups as g
from asyncengine.plugins_api import (EndpointPlugin, StatLoggerBase, load_endpoint_plugins,
                                     load_stat_logger_plugin_factories)


class GoodLogger(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats):
        pass


NOT_A_LOGGER = object()


class AdminEndpoint:  # vLLM's form: a plain class
    name = "admin"
    required_tasks = None

    def attach_router(self, app):
        pass


class GenerateOnly(AdminEndpoint):
    name = "generate_only"
    required_tasks = ("generate",)


def installed(*entries, group=g.STAT_LOGGER):
    return [discovery.InstalledPlugin(group=group, name=name, value=f"{__name__}:{attr}",
                                      distribution=None, version=None,
                                      entry_point=metadata.EntryPoint(name, f"{__name__}:{attr}",
                                                                      group.entry_point_group))
            for name, attr in entries]


def test_the_allowed_classes_are_found_in_order(monkeypatch):
    monkeypatch.setattr(discovery, "installed_plugins", lambda: installed(("good", "GoodLogger"),
                                                                          ("other", "GoodLogger")))
    assert load_stat_logger_plugin_factories() == [GoodLogger, GoodLogger]
    assert load_stat_logger_plugin_factories("good") == [GoodLogger]
    assert load_stat_logger_plugin_factories("") == []  # vLLM's VLLM_PLUGINS="": none


def test_an_entry_point_that_is_no_stat_logger_is_a_type_error_naming_it(monkeypatch):
    monkeypatch.setattr(discovery, "installed_plugins", lambda: installed(("bad", "NOT_A_LOGGER")))
    with pytest.raises(TypeError, match="Stat logger plugin 'bad' must be a subclass of StatLoggerBase"):
        load_stat_logger_plugin_factories()


def test_endpoint_plugins_load_when_allowed_and_their_tasks_are_supported(monkeypatch):
    monkeypatch.delenv("ASYNCENGINE_PLUGINS", raising=False)
    monkeypatch.setattr(discovery, "installed_plugins", lambda: installed(
        ("admin", "AdminEndpoint"), ("generate_only", "GenerateOnly"), group=g.ENDPOINT))
    assert load_endpoint_plugins(("generate",)) == []  # opt-in: nothing unless the allow-list names it
    loaded = load_endpoint_plugins(("generate",), "admin,generate_only")
    assert [type(plugin) for plugin in loaded] == [AdminEndpoint, GenerateOnly]
    assert [type(p) for p in load_endpoint_plugins(("embed",), "admin,generate_only")] == [AdminEndpoint]
    assert [type(p) for p in load_endpoint_plugins(None, "admin,generate_only")] == [AdminEndpoint]


def test_vllms_plain_endpoint_class_is_an_endpoint_plugin_as_vllms_protocol_says():
    assert isinstance(AdminEndpoint(), EndpointPlugin)
    assert not isinstance(GoodLogger(), EndpointPlugin)
