"""`kv_transfer_config`: which KV connector to run, in which role, with what settings.

The option stays a plain dict in EngineConfig (it travels to every process inside the config, as vLLM's
`--kv-transfer-config '{...}'` JSON does); this module checks it when the config is built and gives the
typed view every process reads (a config, so in asyncengine/config: the floor). It imports neither
torch nor any connector, so the frontend can check
the keys and the role before anything starts; the connector's name is checked where the registry is
read (the engine core and each worker), because a general plugin may register it there.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncengine.errors import ConfigError

PRODUCER, CONSUMER, BOTH = "producer", "consumer", "both"
ROLES = (PRODUCER, CONSUMER, BOTH)
# vLLM spells the roles kv_producer / kv_consumer / kv_both: accepted, so a vLLM config ports unchanged.
_VLLM_ROLES = {"kv_producer": PRODUCER, "kv_consumer": CONSUMER, "kv_both": BOTH}
FIELD = "kv_transfer_config"


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The checked `kv_transfer_config`.

    kv_connector: a name registered with KVConnectorFactory.register_connector (built-in:
        "LocalDiskConnector"), or, with kv_connector_module_path, the class's name in that module.
    kv_role: "producer" (saves KV), "consumer" (loads KV) or "both".
    kv_connector_module_path: "pkg.mod": import kv_connector from this module instead of looking it up
        in the registry. It wins over a registry entry of the same name, and the report says so.
    kv_connector_extra_config: the connector's own settings (LocalDiskConnector: {"path": DIR}).
    """

    kv_connector: str
    kv_role: str = BOTH
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in (PRODUCER, BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in (CONSUMER, BOTH)


KNOWN_KEYS = tuple(field.name for field in msgspec.structs.fields(KVTransferConfig))


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """The typed view of `kv_transfer_config` (None when unset), or ConfigError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{FIELD} must be a JSON object with the keys {', '.join(KNOWN_KEYS)}; got {value!r}",
                          field=FIELD)
    unknown = sorted(set(value) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError(f"{FIELD}: unknown key(s) {', '.join(map(repr, unknown))}; the known keys are "
                          f"{', '.join(KNOWN_KEYS)}", field=FIELD)
    connector = value.get("kv_connector")
    if not isinstance(connector, str) or not connector.strip():
        raise ConfigError(f"{FIELD}: kv_connector must name a KV connector (the built-in one is "
                          "'LocalDiskConnector', or a name a plugin registered); got "
                          f"{connector!r}", field=FIELD)
    role = value.get("kv_role", BOTH)
    role = _VLLM_ROLES.get(role, role)
    if role not in ROLES:
        raise ConfigError(f"{FIELD}: kv_role must be one of {', '.join(ROLES)} (or vLLM's "
                          f"{', '.join(_VLLM_ROLES)}); got {value.get('kv_role')!r}", field=FIELD)
    module_path = value.get("kv_connector_module_path")
    if module_path is not None and (not isinstance(module_path, str) or not module_path.strip()
                                    or ":" in module_path):
        raise ConfigError(f"{FIELD}: kv_connector_module_path must be a module path 'pkg.mod' (the class is "
                          f"kv_connector, {connector!r}, in it); got {module_path!r}", field=FIELD)
    extra = value.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError(f"{FIELD}: kv_connector_extra_config must be a JSON object; got {extra!r}", field=FIELD)
    return KVTransferConfig(kv_connector=connector.strip(), kv_role=role,
                            kv_connector_module_path=module_path.strip() if module_path else None,
                            kv_connector_extra_config=dict(extra))
