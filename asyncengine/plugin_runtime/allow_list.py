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
OPTION_SOURCE = "--plugins"

# The messages, as templates: the start-up timeline page (timeline_rules.py) words them the same way.
OPT_IN_REASON = "opt-in: {group} plugins load only when named in the allow-list (--plugins)"
NOT_NAMED_REASON = "not allowed ({source} does not name it)"
UNKNOWN_NAMES_ERROR = "{source} names plugin(s) {unknown} that are not installed; installed: {installed}"
INSTALLED_PLUGIN = "{name} ({entry_point_group})"
NONE_INSTALLED = "none"


@dataclass(frozen=True)
class AllowList:
    names: frozenset[str] | None  # None: unset
    source: str

    @classmethod
    def resolve(cls, option: str | None) -> "AllowList":
        if option is not None:
            return cls(_parse(option), OPTION_SOURCE)
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
            listing = ", ".join(INSTALLED_PLUGIN.format(name=p.name, entry_point_group=p.group.entry_point_group)
                                for p in installed) or NONE_INSTALLED
            raise ConfigError(UNKNOWN_NAMES_ERROR.format(source=self.source, unknown=", ".join(unknown),
                                                         installed=listing), field="plugins")

    def verdict(self, plugin: InstalledPlugin) -> str | None:
        """None when the plugin may load; else why it is skipped."""
        if self.names is None:
            if plugin.group.opt_in:
                return OPT_IN_REASON.format(group=plugin.group.key)
            return None
        if plugin.name not in self.names:
            return NOT_NAMED_REASON.format(source=self.source)
        return None


def _parse(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())
