"""The KV connector interface (KVConnectorBase, its role, context, request view and metadata): in the
floor, asyncengine.interfaces.kv_connector (its docstring says which side calls what, in what order);
imported here for the names code and plugins have used."""

from __future__ import annotations

from asyncengine.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
)

__all__ = ["KVConnectorBase", "KVConnectorContext", "KVConnectorMetadata", "KVConnectorRequest", "KVConnectorRole"]
