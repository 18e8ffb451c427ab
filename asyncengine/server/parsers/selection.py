"""The parsers a server configuration names (`--tool-call-parser`, `--reasoning-parser`, and the plugin
files or modules that register them), looked up by name.

`serve` checks them before the engine starts (`check_configured_parsers`), so a misspelt name fails in
a moment with the known names listed, not after the model has loaded; the app looks them up again
when it is built (a plugin is imported once: the second lookup finds what the first registered). A
general plugin (entry-point group `asyncengine.general_plugins`) may register parsers too, but it loads
with the engine: while one that the allow-list lets load is installed, an unknown name is left to the
app's lookup, after the engine has started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError
from asyncengine.interfaces.parsers import ReasoningParser, ReasoningParserManager, ToolParser, ToolParserManager
from asyncengine.interfaces.registry import reads
from asyncengine.plugin_runtime import groups
from asyncengine.plugin_runtime.allow_list import AllowList
from asyncengine.plugin_runtime.discovery import installed_plugins

if TYPE_CHECKING:
    from asyncengine.server.config import ServerConfig


@reads("tool_parsers", "frontend")
def configured_tool_parser(config: ServerConfig) -> type[ToolParser] | None:
    """The tool parser class `config.tool_call_parser` names (after loading `config.tool_parser_plugin`);
    None when none is named. ConfigError listing the known names for an unknown one."""
    if config.tool_parser_plugin:
        ToolParserManager.import_tool_parser(config.tool_parser_plugin)
    return ToolParserManager.get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None


@reads("reasoning_parsers", "frontend")
def configured_reasoning_parser(config: ServerConfig) -> type[ReasoningParser] | None:
    """The reasoning parser class `config.reasoning_parser` names, as configured_tool_parser."""
    if config.reasoning_parser_plugin:
        ReasoningParserManager.import_reasoning_parser(config.reasoning_parser_plugin)
    return ReasoningParserManager.get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None


def check_configured_parsers(config: ServerConfig, allow_list_option: str | None = None) -> None:
    """Fail (StartupError, ConfigError) unless every parser and parser plugin `config` names loads, or
    a name is unknown while general plugins that may register it are installed and allowed
    (`allow_list_option`: the engine's `--plugins`)."""
    try:
        configured_tool_parser(config)
        configured_reasoning_parser(config)
    except ConfigError as error:
        if error.field in ("tool_call_parser", "reasoning_parser") and _general_plugins_to_load(allow_list_option):
            return
        raise


def _general_plugins_to_load(allow_list_option: str | None) -> bool:
    allow_list = AllowList.resolve(allow_list_option)
    return any(plugin.group is groups.GENERAL and allow_list.verdict(plugin) is None for plugin in installed_plugins())
