"""The class `kv_connector_module_path: "ae_kv_connector_example.via_module_path"` names (C6): the same
connector as the registered one, telling its records apart."""

from __future__ import annotations

from ae_kv_connector_example.connector import ExampleDiskConnector as _Registered

__all__ = ["ExampleDiskConnector"]


class ExampleDiskConnector(_Registered):
    variant = "module path"
