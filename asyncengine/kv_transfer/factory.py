"""KVConnectorFactory: the registry of KV connectors, and the one function that builds a connector.

    KVConnectorFactory.register_connector("MyConnector", "my_pkg.connector", "MyConnector")

Entries are lazy ("pkg.mod:Class", imported when first built), so registering imports nothing. Register
from a general plugin: the registry is read in the engine core (the scheduler side) and in every worker
(the worker side), and a key registered only in the frontend is missing there (the start-up manifest
check names it). `kv_transfer_config.kv_connector_module_path` names the module instead; it wins
over a registry entry of the same name, and the start-up report says which one was used.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from asyncengine.config.kv_transfer import FIELD, KVTransferConfig
from asyncengine.errors import ConfigError
from asyncengine.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorRole,
)
from asyncengine.interfaces.registry import contract_problem, describe, reads

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig


class ConnectorChoice:
    """The class built, and where it came from (for the start-up report)."""

    def __init__(self, cls: type[KVConnectorBase], origin: str) -> None:
        self.cls = cls
        self.origin = origin

    @property
    def class_path(self) -> str:
        return describe(self.cls)


@reads("kv_connectors", "engine core")  # the scheduler side
@reads("kv_connectors", "worker")  # the worker side
@reads("hook:kv_connector_module_path", "engine core")
@reads("hook:kv_connector_module_path", "worker")
def connector_class(config: KVTransferConfig) -> ConnectorChoice:
    """The connector class `config` names: from kv_connector_module_path when set, else the registry."""
    from asyncengine.interfaces.imports import import_by_path

    name = config.kv_connector
    entry = KVConnectorFactory.get(name)
    if config.kv_connector_module_path:
        path = f"{config.kv_connector_module_path}:{name}"
        shadowed = (f"; it wins over the registry entry {name!r} ({describe(entry.implementation)}, registered by "
                    f"{entry.owner})" if entry is not None else "; no registry entry of that name")
        origin = f"kv_connector_module_path {config.kv_connector_module_path!r}{shadowed}"
    elif entry is not None:
        path, origin = entry.implementation, f"registry entry {name!r}, registered by {entry.owner}"
    else:
        raise ConfigError(
            f"{FIELD}: kv_connector {name!r} is not a registered KV connector here; registered: "
            f"{', '.join(KVConnectorFactory.keys())}. Register it with KVConnectorFactory.register_connector "
            "from a general plugin (so that the engine core and every worker have it), or name its module "
            "with kv_connector_module_path", field=FIELD)
    try:
        cls = import_by_path(path, what=f"{FIELD} kv_connector {name!r}") if isinstance(path, str) else path
    except Exception as exc:  # an import error (the message names the path) or the module raising: named
        raise ConfigError(f"{FIELD}: kv_connector {name!r} ({origin}) could not be imported: {exc}",
                          field=FIELD) from exc
    problem = contract_problem(cls, KVConnectorBase, "asyncengine.plugins_api.KVConnectorBase")
    if problem:
        raise ConfigError(f"{FIELD}: kv_connector {name!r} ({origin}) {problem}", field=FIELD)
    return ConnectorChoice(cls, origin)


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     context: KVConnectorContext) -> tuple[KVConnectorBase, ConnectorChoice]:
    choice = connector_class(config)
    return choice.cls(config, role, context), choice


def connector_record(connector: KVConnectorBase, choice: ConnectorChoice, *, phase: str, started: float):
    """The start-up record that names the connector, its side, its class and where that came from."""
    from asyncengine.wire.startup import StartupRecord
    from asyncengine.plugin_runtime.records import current_process_role

    side = "scheduler side" if connector.role is KVConnectorRole.SCHEDULER else f"worker side, rank {connector.context.rank}"
    detail = connector.describe()
    reason = (f"{connector.config.kv_connector} = {choice.class_path} ({side}, kv_role {connector.config.kv_role}); "
              f"from the {choice.origin}" + (f"; {detail}" if detail else ""))
    return StartupRecord(pid=os.getpid(), role=current_process_role(), phase=phase, plugin="kv connector",
                         reason=reason, start=started, duration=time.time() - started)


def context_for(engine_config: EngineConfig, model_config: ModelConfig, *, rank: int = 0) -> KVConnectorContext:
    return KVConnectorContext(
        block_size=engine_config.block_size, tensor_parallel_size=engine_config.tensor_parallel_size, rank=rank,
        architecture=model_config.architectures[0], dtype=model_config.dtype, model=model_config.served_model_name,
        engine_config=engine_config, model_config=model_config,
    )


__all__ = ["ConnectorChoice", "connector_class", "connector_record", "context_for", "create_connector"]
