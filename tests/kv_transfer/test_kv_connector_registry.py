"""KVConnectorFactory (R6), kv_transfer_config checks, and kv_connector_module_path winning (C6)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from asyncengine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.interfaces.kv_connector import KVConnectorBase
from asyncengine.config.kv_transfer import parse_kv_transfer_config
from asyncengine.interfaces.kv_connector import KVConnectorFactory, _KVConnectorFactory
from asyncengine.kv_transfer.factory import connector_class
from asyncengine.kv_transfer.local_disk import LocalDiskConnector
from asyncengine.plugin_runtime.config_hooks import hooks_checked, load_hook
from asyncengine.interfaces.roles import ENGINE_CORE, WORKER
from asyncengine.interfaces.tables import all_registries
from asyncengine.interfaces.registry import RegistrationError, current_registrant


class MineConnector(KVConnectorBase):
    pass


class OtherConnector(KVConnectorBase):
    pass


class NotAConnector:
    pass


def registered_by(owner: str, factory, *args, **kwargs) -> None:
    token = current_registrant.set(owner)
    try:
        factory.register_connector(*args, **kwargs)
    finally:
        current_registrant.reset(token)


def test_the_built_in_connector_is_registered_in_code_and_read_in_the_engine_core_and_worker():
    assert KVConnectorFactory.owners()["LocalDiskConnector"] == "built-in"
    registry, readers = all_registries()["kv_connectors"]
    assert registry is KVConnectorFactory and readers == {ENGINE_CORE, WORKER}
    config = parse_kv_transfer_config({"kv_connector": "LocalDiskConnector"})
    choice = connector_class(config)
    assert choice.cls is LocalDiskConnector
    assert choice.origin == "registry entry 'LocalDiskConnector', registered by built-in"


def test_registration_is_idempotent_and_a_clash_names_both_owners():
    factory = _KVConnectorFactory()
    registered_by("plugin 'a'", factory, "Mine", __name__, "MineConnector")
    registered_by("plugin 'b'", factory, "Mine", __name__, "MineConnector")  # the same: a no-op
    assert factory.owners()["Mine"] == "plugin 'a'"
    with pytest.raises(RegistrationError) as caught:
        registered_by("plugin 'b'", factory, "Mine", __name__, "OtherConnector")
    assert str(caught.value) == (
        f"KV connector 'Mine' is already registered to {__name__}:MineConnector (by plugin 'a'); plugin 'b' tried "
        f"to register {__name__}:OtherConnector: pass override=True to replace it")
    registered_by("plugin 'b'", factory, "Mine", __name__, "OtherConnector", override=True)
    assert factory.get("Mine").implementation == f"{__name__}:OtherConnector"


@pytest.mark.parametrize("args", [("X", "pkg.mod:Class", "Class"), ("X", "pkg.mod", ""), ("X", "", "Class")])
def test_register_connector_takes_a_module_and_a_class_name(args):
    with pytest.raises(ConfigError, match=r"register_connector\('X', \.\.\.\): .* must be a non-empty name"):
        _KVConnectorFactory().register_connector(*args)


def test_an_unknown_connector_lists_the_registered_ones():
    config = parse_kv_transfer_config({"kv_connector": "NoSuchConnector"})
    with pytest.raises(ConfigError) as caught:
        connector_class(config)
    message = str(caught.value)
    assert "kv_connector 'NoSuchConnector' is not a registered KV connector here; registered: " in message
    assert "LocalDiskConnector" in message and "register_connector from a general plugin" in message
    assert caught.value.field == "kv_transfer_config"


@pytest.mark.parametrize("value, expected", [
    ({"kv_connector": "A", "kv_rol": "producer"},
     "kv_transfer_config: unknown key(s) 'kv_rol'; the known keys are kv_connector, kv_role, "
     "kv_connector_module_path, kv_connector_extra_config"),
    ({"kv_connector": "A", "kv_role": "sender"},
     "kv_transfer_config: kv_role must be one of producer, consumer, both (or vLLM's kv_producer, kv_consumer, "
     "kv_both); got 'sender'"),
    ({"kv_role": "both"}, "kv_transfer_config: kv_connector must name a KV connector (the built-in one is "
                          "'LocalDiskConnector', or a name a plugin registered); got None"),
    ({"kv_connector": "A", "kv_connector_extra_config": [1]},
     "kv_transfer_config: kv_connector_extra_config must be a JSON object; got [1]"),
    ("LocalDiskConnector", "kv_transfer_config must be a JSON object with the keys kv_connector, kv_role, "
                           "kv_connector_module_path, kv_connector_extra_config; got 'LocalDiskConnector'"),
])
def test_bad_configs_say_what_is_wrong(value, expected):
    with pytest.raises(ConfigError) as caught:
        EngineConfig(kv_transfer_config=value)
    assert str(caught.value) == expected and caught.value.field == "kv_transfer_config"


def test_vllm_role_names_are_accepted():
    config = EngineConfig(kv_transfer_config={"kv_connector": "A", "kv_role": "kv_consumer"}).kv_transfer
    assert config.kv_role == "consumer" and config.is_consumer and not config.is_producer
    assert EngineConfig().kv_transfer is None


@pytest.fixture
def module_on_path(tmp_path, monkeypatch):
    (tmp_path / "ae_kv_unit_mod.py").write_text(textwrap.dedent("""
        from asyncengine.plugins_api import KVConnectorBase

        class LocalDiskConnector(KVConnectorBase):
            pass

        class NotOne:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ae_kv_unit_mod"
    sys.modules.pop("ae_kv_unit_mod", None)


def test_the_module_path_wins_over_a_registry_entry_and_says_so(module_on_path):
    config = parse_kv_transfer_config({"kv_connector": "LocalDiskConnector", "kv_connector_module_path": module_on_path})
    choice = connector_class(config)
    assert choice.cls is sys.modules[module_on_path].LocalDiskConnector and choice.cls is not LocalDiskConnector
    assert choice.origin == (
        "kv_connector_module_path 'ae_kv_unit_mod'; it wins over the registry entry 'LocalDiskConnector' "
        "(asyncengine.kv_transfer.local_disk:LocalDiskConnector, registered by built-in)")


def test_the_module_path_is_a_config_hook_checked_before_spawning(module_on_path):
    config = EngineConfig(kv_transfer_config={"kv_connector": "NotOne", "kv_connector_module_path": module_on_path})
    option, path = "kv_connector_module_path", f"{module_on_path}:NotOne"
    assert hooks_checked(config, {"frontend"}) == [(option, path)]
    assert hooks_checked(config, {ENGINE_CORE}) == hooks_checked(config, {WORKER}) == [(option, path)]
    with pytest.raises(ConfigError) as caught:
        load_hook(option, path)
    assert str(caught.value).startswith(f"{option}: {path} is <class 'ae_kv_unit_mod.NotOne'>, not a subclass of "
                                        "asyncengine.plugins_api.KVConnectorBase")
    with pytest.raises(ConfigError, match="not a subclass of asyncengine.plugins_api.KVConnectorBase"):
        connector_class(config.kv_transfer)


def test_a_module_path_that_does_not_import_is_named():
    config = parse_kv_transfer_config({"kv_connector": "X", "kv_connector_module_path": "ae_no_such_module_here"})
    with pytest.raises(ConfigError) as caught:
        connector_class(config)
    assert "kv_connector 'X' (kv_connector_module_path 'ae_no_such_module_here'; no registry entry of that name) " \
           "could not be imported" in str(caught.value)


def test_a_connector_the_frontend_registered_and_a_child_lacks_is_named_by_the_manifest_check(monkeypatch):
    from asyncengine.errors import MissingRegistration
    from asyncengine.wire.startup import Manifest
    from asyncengine.plugin_runtime.manifest import check_manifest
    from asyncengine.plugin_runtime import records
    from asyncengine.plugin_runtime.records import StartupTrace

    # A trace names this process's role once, for good: keep this test from naming the test process's.
    monkeypatch.setattr(records, "_process_role", records._process_role)
    frontend = Manifest(process="the frontend (pid 1)", registries={"kv_connectors": {
        "LocalDiskConnector": "built-in", "Mine": "the calling script"}})
    with pytest.raises(MissingRegistration) as caught:
        check_manifest(frontend, {ENGINE_CORE}, StartupTrace("engine core"))
    assert str(caught.value).startswith(
        "KV connector 'Mine' is missing from registry 'kv_connectors' here, while the frontend (pid 1) has it "
        "(registered there by the calling script)")
    check_manifest(frontend, {"frontend"}, StartupTrace("frontend"))  # the frontend does not read it
