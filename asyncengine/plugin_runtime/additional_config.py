"""`additional_config` (docs/reference.md): a dict of options for the platform or a plugin, each
key validated by whoever claims it; a key nobody claims is an error, never silently ignored.

Two ways to claim a key:
- a platform lists it in `Platform.additional_config_keys` and validates its value in
  `check_and_update_config` (which runs in the platform phase, before this check);
- a general plugin calls `AdditionalConfigRegistry.claim("key", validator)`; the validator is called
  with the value and raises to refuse it (the error names the key and the claimant).

Checked in the frontend's config-hooks phase, before anything is spawned; every process receives the
dict in the config, so a plugin reads its own key from `config.additional_config` wherever it runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError

# The table (and `claim`) is in the floor, asyncengine.interfaces.additional_config; imported here for
# the name code and plugins have used.
from asyncengine.interfaces.additional_config import AdditionalConfigRegistry
from asyncengine.interfaces.registry import describe, reads
from asyncengine.plugin_runtime.groups import PHASE_CONFIG_HOOKS

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform
    from asyncengine.config.engine import EngineConfig


@reads("additional_config", "frontend")
def check_additional_config(config: EngineConfig, platform: type[Platform], trace: Any = None) -> None:
    """Every key of `config.additional_config` must be claimed, and its claimant's validator accept it."""
    values = config.additional_config or {}
    if not isinstance(values, dict):
        raise ConfigError(f"additional_config must be a dict, got {values!r}", field="additional_config")
    platform_keys = tuple(getattr(platform, "additional_config_keys", ()) or ())
    platform_name = f"platform {getattr(platform, 'device_name', None) or platform!r}"
    for key, value in values.items():
        started = time.time()
        entry = AdditionalConfigRegistry.get(key) if isinstance(key, str) else None
        if key in platform_keys:
            claimant = platform_name  # validated by its check_and_update_config
        elif entry is not None:
            claimant = f"{entry.owner} (validator {describe(entry.implementation)})"
            try:
                entry.implementation(value)
            except Exception as exc:
                raise ConfigError(f"additional_config[{key!r}]={value!r} was refused by {claimant}: "
                                  f"{type(exc).__name__}: {exc}", field="additional_config") from exc
        else:
            claimed = sorted({*platform_keys, *AdditionalConfigRegistry.keys()})
            raise ConfigError(
                f"additional_config key {key!r} is claimed by no platform or plugin; claimed keys: "
                f"{', '.join(map(repr, claimed)) or 'none'} (a platform lists its keys in additional_config_keys; "
                "a general plugin calls AdditionalConfigRegistry.claim(key, validator))",
                field="additional_config",
            )
        if trace is not None:
            trace.add(PHASE_CONFIG_HOOKS, started=started, plugin=f"additional_config[{key!r}] (claimed by {claimant})")
