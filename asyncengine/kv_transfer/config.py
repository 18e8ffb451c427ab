"""`kv_transfer_config`'s typed view and its check: in asyncengine.config.kv_transfer (the floor, which
EngineConfig and the connector interface read); imported here for the names code has used."""

from __future__ import annotations

from asyncengine.config.kv_transfer import (
    BOTH,
    CONSUMER,
    FIELD,
    KNOWN_KEYS,
    PRODUCER,
    ROLES,
    KVTransferConfig,
    parse_kv_transfer_config,
)

__all__ = ["BOTH", "CONSUMER", "FIELD", "KNOWN_KEYS", "PRODUCER", "ROLES", "KVTransferConfig",
           "parse_kv_transfer_config"]
