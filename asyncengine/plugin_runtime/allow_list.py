"""The allow-list: `--plugins a,b` (EngineConfig.plugins) or else ASYNCENGINE_PLUGINS.

Unset: every installed plugin loads, except endpoint plugins, which load only when named (they add
network routes). Set to the empty string: none. Names are trimmed; a name that matches no installed
entry point is an error (CLI exit 2) listing what is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.discovery import InstalledPlugin

ENV_VAR = "ASYNCENGINE_PLUGINS"


@dataclass(frozen=True)
class AllowList:
    names: frozenset[str] | None  # None: unset
    source: str

    @classmethod
    def resolve(cls, option: str | None) -> "AllowList":
        if option is not None:
            return cls(_parse(option), "--plugins")
        if ENV_VAR in os.environ:
            return cls(_parse(os.environ[ENV_VAR]), ENV_VAR)
        return cls(None, "unset")

    def as_option(self) -> str | None:
        """The value that reproduces this allow-list in a child process's EngineConfig.plugins."""
        return None if self.names is None else ",".join(sorted(self.names))

    def check(self, installed: list[InstalledPlugin]) -> None:
        if self.names is None:
            return
        known = {plugin.name for plugin in installed}
        unknown = sorted(self.names - known)
        if unknown:
            listing = ", ".join(f"{p.name} ({p.group.entry_point_group})" for p in installed) or "none"
            raise ConfigError(
                f"{self.source} names plugin(s) {', '.join(unknown)} that are not installed; installed: {listing}",
                field="plugins",
            )

    def verdict(self, plugin: InstalledPlugin) -> str | None:
        """None when the plugin may load; else why it is skipped."""
        if self.names is None:
            if plugin.group.opt_in:
                return f"opt-in: {plugin.group.key} plugins load only when named in the allow-list (--plugins)"
            return None
        if plugin.name not in self.names:
            return f"not allowed ({self.source} does not name it)"
        return None


def _parse(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())
