"""The six entry-point groups: which processes load each, and in which start-up phase.

The table is the single source for both loading (phases.py) and the `plugins timeline` plan, so the
plan cannot drift from what really happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER

PHASE_PLATFORM = "platform"
PHASE_GENERAL = "general plugins"
PHASE_ROLE_GROUPS = "role groups"
PHASE_CONFIG_HOOKS = "config hooks"
PHASE_MANIFEST = "manifest check"
PLUGIN_PHASES = (PHASE_PLATFORM, PHASE_GENERAL, PHASE_ROLE_GROUPS, PHASE_CONFIG_HOOKS, PHASE_MANIFEST)


@dataclass(frozen=True)
class Group:
    key: str
    entry_point_group: str
    roles: frozenset[str]
    phase: str
    value: str  # what the entry point names, for messages
    opt_in: bool = False  # loads only when named in the allow-list


GENERAL = Group("general", "asyncengine.general_plugins", frozenset({FRONTEND, ENGINE_CORE, WORKER}),
                PHASE_GENERAL, "a zero-argument callable (sync or async)")
PLATFORM = Group("platform", "asyncengine.platform_plugins", frozenset({FRONTEND, ENGINE_CORE, WORKER}),
                 PHASE_PLATFORM, "a callable returning a Platform subclass path, or None")
IO_PROCESSOR = Group("io_processor", "asyncengine.io_processor_plugins", frozenset({FRONTEND}),
                     PHASE_ROLE_GROUPS, "a callable returning an IOProcessor subclass path")
STAT_LOGGER = Group("stat_logger", "asyncengine.stat_logger_plugins", frozenset({FRONTEND}),
                    PHASE_ROLE_GROUPS, "a StatLoggerBase subclass")
ENDPOINT = Group("endpoint", "asyncengine.endpoint_plugins", frozenset({FRONTEND}),
                 PHASE_ROLE_GROUPS, "a factory returning an EndpointPlugin", opt_in=True)
LOGITS_PROCESSOR = Group("logits_processor", "asyncengine.logits_processors", frozenset({FRONTEND, WORKER}),
                         PHASE_ROLE_GROUPS, "a LogitsProcessor subclass")

GROUPS = (GENERAL, PLATFORM, IO_PROCESSOR, STAT_LOGGER, ENDPOINT, LOGITS_PROCESSOR)
BY_ENTRY_POINT_GROUP = {group.entry_point_group: group for group in GROUPS}
