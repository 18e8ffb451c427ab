"""Installed plugins: the entry points of our six groups, with their distribution and version."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from asyncengine.plugin_runtime.groups import GROUPS, Group


@dataclass(frozen=True)
class InstalledPlugin:
    group: Group
    name: str  # the entry point's name: what the allow-list names
    value: str  # "package.module:attr"
    distribution: str | None
    version: str | None
    entry_point: metadata.EntryPoint

    @property
    def label(self) -> str:
        origin = f" from {self.distribution} {self.version}" if self.distribution else ""
        return f"plugin {self.name!r} ({self.group.entry_point_group}{origin})"


def installed_plugins() -> list[InstalledPlugin]:
    """Every installed plugin of the six groups, in a deterministic order: by group, then by name."""
    found: dict[tuple[str, str], InstalledPlugin] = {}
    every_entry_point = metadata.entry_points()  # one scan of the installed distributions, not one per group
    for group in GROUPS:
        for entry_point in every_entry_point.select(group=group.entry_point_group):
            dist = getattr(entry_point, "dist", None)
            key = (group.entry_point_group, entry_point.name)
            if key in found:
                continue  # the same distribution seen twice on the path: the first one wins, as imports do
            found[key] = InstalledPlugin(
                group=group,
                name=entry_point.name,
                value=entry_point.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                entry_point=entry_point,
            )
    order = {group.key: index for index, group in enumerate(GROUPS)}
    return sorted(found.values(), key=lambda p: (order[p.group.key], p.name))
