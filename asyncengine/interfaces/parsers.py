"""Tool-call and reasoning parsers (docs/reference.md, parsers): the classes a parser plugin subclasses,
the shapes they hand back to the chat completions route, and the two tables of them.

`ToolParserManager` maps a name (`--tool-call-parser NAME`) to a ToolParser class, `ReasoningParserManager`
one (`--reasoning-parser NAME`) to a ReasoningParser class; plugins add to them with
`@ToolParserManager.register_module("name")` (vLLM's shape). The built-in parsers (BUILT_IN_TOOL_PARSERS,
BUILT_IN_REASONING_PARSERS) are registered here by path, so every process knows their names; their code, and the
loading of a parser plugin file given on the command line (`--tool-parser-plugin`,
`--reasoning-parser-plugin`), are the server's (asyncengine/server/parsers/), which passes its loader
in here when it is imported.

The shapes mirror OpenAI's chat API, so the route can put them into responses unchanged. Stream deltas
omit unset fields: a chunk carries only what changed, which is what OpenAI's clients expect.
"""

from __future__ import annotations

import re
import secrets
from types import ModuleType
from typing import Any

import msgspec

from asyncengine.errors import ConfigError
from asyncengine.interfaces.parser_plugins import import_plugin
from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError

# -- what parsers hand back -------------------------------------------------------------------------------


def new_tool_call_id() -> str:
    """A fresh tool call id in OpenAI's shape: "call_" and 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON string, as OpenAI's API has it (clients json.loads it themselves)


class ToolCall(msgspec.Struct, kw_only=True):
    # No omit_defaults: OpenAI's clients expect "type" in every complete tool call.
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int  # which tool call of this choice the delta belongs to: 0, 1, ...
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chunk's change. `reasoning` is vLLM's current name for the reasoning text; `reasoning_content`,
    its earlier name, carries the same text for one more release (docs/server.md): a parser may set
    either, and both are sent. Set both to different texts and `reasoning` wins, as in vLLM."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    def __post_init__(self) -> None:
        if self.reasoning is None:
            self.reasoning = self.reasoning_content
        else:
            self.reasoning_content = self.reasoning


class ExtractedToolCalls(msgspec.Struct, kw_only=True):
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the tool calls; None when there is none


# -- the classes plugins subclass -------------------------------------------------------------------------


class ToolParser:
    """Base class of tool-call parsers. `tokenizer` may be None (a parser that needs one says so).

    The route makes one parser instance per request, so a parser may keep streaming state on itself.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation (say, to keep special tokens); the default keeps it."""
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        """The tool calls in a complete output, and the content outside them."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls")

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        """What to send for the newest delta; None means nothing yet (text is being held back)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls_streaming")


class ReasoningParser:
    """Base class of reasoning parsers. `tokenizer` may be None (a parser that needs one says so).

    The route makes one parser instance per request, so a parser may keep streaming state on itself.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """(reasoning, content) of a complete output; None for a part that is absent or empty."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_reasoning")

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        """What to send for the newest delta; None means nothing yet (text is being held back)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_reasoning_streaming")

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether the reasoning has ended in these token ids (the latest of a prompt or an output, the
        newest last): the engine core asks it after each token of a constrained request, whose grammar
        starts once this is true (docs/structured_outputs.md, "With reasoning")."""
        raise NotImplementedError(f"{type(self).__name__} does not implement is_reasoning_end, which structured "
                                  "outputs need when structured_outputs_config names a reasoning parser")


# -- the tables -------------------------------------------------------------------------------------------

class ParserRegistry(Registry[Any]):
    """A registry of parser classes, all subclasses of `base`, with vLLM's `register_module` shape.

    `field` is the configuration field that selects a parser (named by lookup errors) and
    `plugin_option` the command-line option that loads plugins (named by plugin errors).
    """

    def __init__(self, name: str, what: str, *, base: type, field: str, option: str, plugin_option: str) -> None:
        super().__init__(
            name, what, base, field=field,
            unknown=(f"unknown {what} {{key!r}}; known: {{known_repr}}. Pass one of these to {option}, or load a "
                     f"plugin that registers it with {plugin_option}"),
            import_error=lambda message, field: ConfigError(message, field=field))
        self.option = option
        self.plugin_option = plugin_option

    def register_module(
        self, name: str | list[str] | type | None = None, force: bool = False, module: type | str | None = None
    ) -> Any:
        """Register a parser class under `name` (a name, a list of aliases, or None for the class name).

        As a decorator: `@Manager.register_module("mine")` (a bare `@Manager.register_module` works
        too). As a call: `Manager.register_module("mine", module=MyParser)`, or lazily with
        `module="package.module:MyParser"`, imported when first looked up. `force=True` replaces a
        parser registered under the same name by someone else; without it that is a RegistrationError
        naming both owners.
        """
        if isinstance(name, type) and module is None:  # the bare decorator: the class came in as `name`
            name, module = None, name
        names = self._names(name)  # checked now, so a bad name fails at the decorator, not at lookup
        if module is not None:
            self._register_all(names, module, force)
            return module

        def decorator(cls: type) -> type:
            self._register_all(names, cls, force)
            return cls

        return decorator

    def import_plugin(self, plugin: str) -> ModuleType:
        """Load a parser plugin (a .py path or a module name); its decorators register its parsers."""
        return import_plugin(plugin, option=self.plugin_option)

    # -- internals ---------------------------------------------------------------------------------

    def _names(self, name: Any) -> list[str] | None:
        if name is None:
            return None  # the class name, known once the class is
        names = [name] if isinstance(name, str) else name
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise RegistrationError(
                f"a {self.what} name must be a non-empty string or a non-empty list of them, got {name!r}"
            )
        return names

    def _register_all(self, names: list[str] | None, module: Any, force: bool) -> None:
        if isinstance(module, str):
            if not re.fullmatch(r"[\w.]+:[\w.]+", module):
                raise RegistrationError(
                    f"a {self.what} given by path must look like 'package.module:Class', got {module!r}"
                )
            if names is None:
                names = [module.rpartition(":")[2]]
        elif not (isinstance(module, type) and issubclass(module, self.base)):
            raise RegistrationError(
                f"a {self.what} must be a subclass of {self.base.__name__} (or a 'package.module:Class' "
                f"string), got {module!r}"
            )
        elif names is None:
            names = [module.__name__]
        for key in names:
            try:
                self.register(key, module, override=force)
            except RegistrationError as exc:
                # The base registry's advice names its own keyword; ours is `force`.
                message = str(exc)
                advice = "pass override=True to replace it"
                if message.endswith(advice):
                    message = message[: -len(advice)] + "pass force=True to register_module to replace it"
                raise RegistrationError(message, field=exc.field) from None


class _ToolParserRegistry(ParserRegistry):
    def __init__(self) -> None:
        super().__init__(
            "tool_parsers", "tool parser", base=ToolParser, field="tool_call_parser",
            option="--tool-call-parser", plugin_option="--tool-parser-plugin",
        )

    def get_tool_parser(self, name: str) -> type[ToolParser]:
        return self.load(name)

    def import_tool_parser(self, plugin: str) -> Any:
        return self.import_plugin(plugin)


class _ReasoningParserRegistry(ParserRegistry):
    def __init__(self) -> None:
        super().__init__(
            "reasoning_parsers", "reasoning parser", base=ReasoningParser, field="reasoning_parser",
            option="--reasoning-parser", plugin_option="--reasoning-parser-plugin",
        )

    def get_reasoning_parser(self, name: str) -> type[ReasoningParser]:
        return self.load(name)

    def import_reasoning_parser(self, plugin: str) -> Any:
        return self.import_plugin(plugin)


ToolParserManager = _ToolParserRegistry()
ReasoningParserManager = _ReasoningParserRegistry()

# The built-in parsers, by path (vLLM's names): their code is the server's (asyncengine/server/parsers/).
BUILT_IN_TOOL_PARSERS = {
    "json_tags": "tool_parsers:JsonTagsToolParser",
    "hermes": "tool_parsers:JsonTagsToolParser",
    "llama3_json": "json_tool_parsers:Llama3JsonToolParser",
    "llama4_json": "json_tool_parsers:Llama3JsonToolParser",
    "mistral": "json_tool_parsers:MistralToolParser",
    "granite": "json_tool_parsers:GraniteToolParser",
    "internlm": "json_tool_parsers:InternLMToolParser",
    "deepseek_v3": "json_tool_parsers:DeepSeekV3ToolParser",
    "deepseek_v31": "json_tool_parsers:DeepSeekV31ToolParser",
    "pythonic": "pythonic_tool_parser:PythonicToolParser",
    "llama4_pythonic": "pythonic_tool_parser:PythonicToolParser",
    "qwen3_coder": "qwen3_coder_tool_parser:Qwen3CoderToolParser",
}
BUILT_IN_REASONING_PARSERS = {
    "think": "ThinkReasoningParser",
    "deepseek_r1": "DeepSeekR1ReasoningParser",
    "qwen3": "Qwen3ReasoningParser",
    "granite": "GraniteReasoningParser",
}
for _name, _where in BUILT_IN_TOOL_PARSERS.items():
    ToolParserManager.register(_name, f"asyncengine.server.parsers.{_where}", owner=BUILT_IN)
for _name, _class in BUILT_IN_REASONING_PARSERS.items():
    ReasoningParserManager.register(_name, f"asyncengine.server.parsers.reasoning_parsers:{_class}", owner=BUILT_IN)


__all__ = [
    "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCalls", "FunctionCall", "ParserRegistry",
    "ReasoningParser", "ReasoningParserManager", "ToolCall", "ToolParser", "ToolParserManager", "new_tool_call_id",
]
