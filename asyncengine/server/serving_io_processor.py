"""POST /v1/io_process: the IO processor chosen by `--io-processor-plugin NAME` (entry-point group
`asyncengine.io_processor_plugins`, one of the extension points).

The request's `data` goes to the plugin's `pre_process`, which returns prompts; each prompt is
generated through the engine with the request's sampling fields (concurrently, as /v1/completions
runs several prompts); the finished outputs, in prompt order, go to `post_process`, whose result is
the response's `data`. A plain method of the plugin runs in a worker thread (it may block), an
`async def` on the event loop. What the plugin raises answers that request only: `RequestError` or
`ValueError` is a 400 (the plugin refused the input), anything else a 500 logged with its traceback;
both name the plugin and the method, and the server keeps serving.

vLLM serves IO processors on POST /pooling, for pooling models. asyncengine generates text, so the
route is its own, under /v1 (the API key applies), with the completion route's sampling fields.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.io_processor import IOProcessor
from asyncengine.interfaces.plugin_code import describe_owner
from asyncengine.plugin_runtime import groups
from asyncengine.plugin_runtime.allow_list import AllowList
from asyncengine.plugin_runtime.discovery import InstalledPlugin, installed_plugins
from asyncengine.server.common import (
    ServingContext, check_model, check_supported, final_outputs, new_id, open_options, open_stream, sampling_params,
    usage,
)
from asyncengine.server.errors import ApiError, bad_request
from asyncengine.server.io_processor_calls import RequestCalls
from asyncengine.server.protocol import IOProcessRequest, IOProcessResponse

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig

FLAG = "--io-processor-plugin"


@dataclass
class IOProcessorSetup:
    """What the route serves: the chosen processor (None: none chosen) and what is installed, for
    the message that says how to choose one."""

    name: str | None = None
    processor: IOProcessor[Any, Any] | None = None
    installed: list[str] = field(default_factory=list)


# -- choosing one at start-up ------------------------------------------------------------------------------


def _installed() -> list[InstalledPlugin]:
    return [plugin for plugin in installed_plugins() if plugin.group is groups.IO_PROCESSOR]


def _describe(installed: list[InstalledPlugin]) -> str:
    if not installed:
        return (f"none is installed: install a distribution with an entry point in the group "
                f"{groups.IO_PROCESSOR.entry_point_group}")
    names = ", ".join(f"{p.name} ({p.distribution} {p.version})" if p.distribution else p.name for p in installed)
    return f"installed: {names}"


def check_io_processor_name(name: str | None, allow_list_option: str | None) -> None:
    """Before the engine starts (a cheap scan of the entry points): a ConfigError when `name` is not an
    installed IO processor the allow-list lets load, listing the installed ones."""
    if not name:
        return
    installed = _installed()
    plugin = next((p for p in installed if p.name == name), None)
    if plugin is None:
        raise ConfigError(f"{FLAG} {name!r} is not an installed IO processor; {_describe(installed)}",
                          field="io_processor_plugin")
    verdict = AllowList.resolve(allow_list_option).verdict(plugin)
    if verdict is not None:
        raise ConfigError(f"{FLAG} {name!r} is installed, but the allow-list skips it ({verdict}): name it in "
                          "--plugins (or ASYNCENGINE_PLUGINS) too", field="io_processor_plugin")


def select_io_processor(engine_config: EngineConfig, loaded: dict[str, type], renderer: Any = None) -> IOProcessorSetup:
    """The IO processor `engine_config.io_processor_plugin` names, built from the classes the frontend's
    plugin phase loaded (`loaded`: entry-point name -> IOProcessor subclass), with `renderer` (vLLM's: the
    tokenizer and the model's config)."""
    installed = _installed()
    name = engine_config.io_processor_plugin
    if not name:
        return IOProcessorSetup(installed=[p.name for p in installed])
    cls = loaded.get(name)
    if cls is None:
        check_io_processor_name(name, engine_config.plugins)  # not installed, or not allowed: says which
        raise ConfigError(f"{FLAG} {name!r} is installed and allowed but did not load in this process (see the "
                          "start-up report: GET /v1/startup, or `asyncengine plugins check`)",
                          field="io_processor_plugin")
    try:
        processor = _build(cls, engine_config, renderer)
    except Exception as exc:  # the plugin's constructor: named, and start-up fails
        raise StartupError(f"IO processor {name!r} ({describe_owner(cls)}) failed in its constructor: "
                           f"{type(exc).__name__}: {exc}") from exc
    return IOProcessorSetup(name=name, processor=processor, installed=[p.name for p in installed])


def _build(cls: type, engine_config: EngineConfig, renderer: Any) -> Any:
    """vLLM's `cls(vllm_config, renderer)`; `cls(vllm_config)` for a constructor that takes one argument."""
    parameters = list(inspect.signature(cls).parameters.values())
    takes_two = any(p.kind is p.VAR_POSITIONAL for p in parameters) or len(
        [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2
    return cls(engine_config, renderer) if takes_two else cls(engine_config)


# -- serving a request -------------------------------------------------------------------------------------


async def create_io_process(context: ServingContext, request: IOProcessRequest,
                            header_id: str | None) -> IOProcessResponse:
    setup: IOProcessorSetup = context.io_processor or IOProcessorSetup()
    if setup.processor is None or setup.name is None:  # (a chosen processor always has its name)
        installed = ", ".join(setup.installed) or "none is installed"
        raise ApiError(400, f"this server has no IO processor: start it with {FLAG} NAME (installed IO "
                            f"processors: {installed})", code="io_processor_not_configured")
    check_model(context, request.model)
    check_supported(request)
    engine = context.engine
    response_id = new_id("ioproc", header_id)
    calls = RequestCalls(setup.name, setup.processor, header_id or response_id)
    prompts = _prompt_list(setup.name, await calls.pre_process(await calls.parse(request)))
    params = await calls.merge_params(sampling_params(request, max_tokens=request.max_tokens, logprobs=None),
                                      "sampling")
    streams = []  # every prompt is validated before any runs
    for index, prompt in enumerate(prompts):
        engine_prompt = _engine_prompt(context, setup.name, index, prompt)
        try:
            streams.append(await open_stream(engine, engine_prompt, params, f"{header_id or response_id}-{index}",
                                             add_special_tokens=request.add_special_tokens, final_only=True,
                                             nowait=True, request=request, **open_options(request)))
        except ApiError as error:
            if error.param is not None and error.param.startswith("prompt"):
                # The user sent `data`, not this prompt: say which of the plugin's prompts it was.
                error.message = f"prompt {index} that IO processor {setup.name!r} built: {error.message}"
            raise
    finals = await final_outputs(streams)
    outputs = [output for output in finals if output is not None]  # every task ran to its final output or raised
    # Encoded here, so that a value JSON cannot hold is the plugin's error, named.
    encoded = calls.encode(await calls.response_value(await calls.post_process(outputs)))
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return IOProcessResponse(id=response_id, created=int(time.time()),
                             model=context.model_name, plugin=setup.name, data=encoded,
                             usage=usage(prompt_tokens, completion_tokens))


def _plugin_error(name: str | None, method: str, status: int, what: str, *, param: str | None = None) -> ApiError:
    """An error the plugin's output caused (its prompts): named with its entry point and the method."""
    message = f"IO processor {name!r} ({method}) {what}"
    if status == 400:
        return bad_request(message, param=param, code="io_processor_refused")
    return ApiError(500, message, type="internal_error", code="io_processor_error")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_list(name: str | None, value: Any) -> list[Any]:
    """pre_process's result as a list of prompts: one prompt (a string, a dict, a flat list of token ids)
    or a list of them."""
    if isinstance(value, (str, dict)):
        return [value]
    if isinstance(value, (list, tuple)):
        if value and all(_is_token_id(item) for item in value):
            return [list(value)]
        return list(value)
    raise _plugin_error(name, "pre_process", 500, f"returned {type(value).__name__}, not a prompt or a list of "
                                                  "prompts (strings, lists of token ids, {'prompt': ...} or "
                                                  "{'prompt_token_ids': [...]})")


def _engine_prompt(context: ServingContext, name: str | None, index: int, prompt: Any) -> str | list[int]:
    """One of the plugin's prompts as the engine takes it: a text (tokenized by the engine, in its
    tokenizer pool) or token ids."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        prompt = prompt["prompt_token_ids"]
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if context.engine.tokenizer is None:
            raise _plugin_error(name, "pre_process", 500, f"returned the text prompt {index}, but the server runs "
                                                          "with skip_tokenizer_init: return token ids")
        return prompt
    if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    raise _plugin_error(name, "pre_process", 500, f"returned {_short(prompt)} as prompt {index}: a prompt is a "
                                                  "string, a list of token ids, {'prompt': str} or "
                                                  "{'prompt_token_ids': [...]}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
