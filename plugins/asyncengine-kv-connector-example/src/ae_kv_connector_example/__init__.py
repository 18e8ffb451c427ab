"""A KV connector from outside asyncengine, registered by a general plugin (R6):

    [project.entry-points."asyncengine.general_plugins"]
    ae_kv_connector_example = "ae_kv_connector_example:register"

    kv_transfer_config={"kv_connector": "ExampleDiskConnector", "kv_role": "both",
                        "kv_connector_extra_config": {"path": DIR}}

`ExampleDiskConnector` keeps KV blocks in a directory of its own layout (a fan-out of subdirectories by
the key's first two hex digits) and records where each of its halves ran. The registration is lazy
(a "pkg.mod" path and a class name): registering imports neither torch nor the connector.

`ae_kv_connector_example.via_module_path` holds a class of the same name for the other door (C6):
    {"kv_connector": "ExampleDiskConnector", "kv_connector_module_path": "ae_kv_connector_example.via_module_path"}
names it directly, and it wins over the registry entry (the start-up report says so).

This package imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from asyncengine.plugins_api import KVConnectorFactory

__all__ = ["CONNECTOR", "register"]

CONNECTOR = "ExampleDiskConnector"


def register() -> None:
    KVConnectorFactory.register_connector(CONNECTOR, "ae_kv_connector_example.connector", "ExampleDiskConnector")
