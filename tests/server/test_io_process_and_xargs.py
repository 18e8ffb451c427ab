"""Without a server: the bodies' `vllm_xargs` (vLLM's per-request extension arguments) and its errors, and
POST /v1/io_process's serving code against a fake engine with IO processors that block, await, refuse,
fail and return what JSON cannot hold. The real server runs them in tests/e2e/test_io_processor_e2e.py."""

from __future__ import annotations

import re
import time

import msgspec
import pytest

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.frontend.processor import InputProcessor
from asyncengine.errors import ConfigError, RequestError, StartupError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.plugins_api import IOProcessor, LogitsProcessor
from asyncengine.server.common import ServingContext, sampling_params
from asyncengine.server.errors import ApiError, from_engine_error, from_validation_error, http_param
from asyncengine.server.protocol import ChatCompletionRequest, CompletionRequest, IOProcessRequest
from asyncengine.server.serving_io_processor import IOProcessorSetup, create_io_process, select_io_processor

# --- vllm_xargs in the bodies ---------------------------------------------------------------------------


def decode(struct, body: dict):
    try:
        return msgspec.json.decode(msgspec.json.encode(body), type=struct)
    except msgspec.ValidationError as error:
        raise from_validation_error(error) from error


XARGS = {"banned_token_ids": [1, 2], "label": "x", "scale": 0.5, "flag": True, "mixed": ["a", 1, 2.5, False]}


@pytest.mark.parametrize("struct, base", [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    (IOProcessRequest, {"data": {"items": ["a"]}}),
])
def test_every_generating_body_takes_vllm_xargs_into_extra_args(struct, base):
    request = decode(struct, {**base, "vllm_xargs": XARGS})
    assert request.vllm_xargs == XARGS
    params = sampling_params(request, max_tokens=4, logprobs=None)
    assert params.extra_args == XARGS
    assert decode(struct, base).vllm_xargs is None
    assert sampling_params(decode(struct, base), max_tokens=4, logprobs=None).extra_args is None


@pytest.mark.parametrize("xargs", [{"deep": {"a": 1}}, {"none": None}, {"nested": [[1]]}, ["not", "a", "dict"]])
def test_values_outside_vllms_schema_are_a_400_naming_vllm_xargs(xargs):
    with pytest.raises(ApiError) as info:
        decode(CompletionRequest, {"prompt": "hi", "vllm_xargs": xargs})
    assert info.value.status == 400 and info.value.param.startswith("vllm_xargs"), info.value.param


def test_a_value_msgpack_cannot_hold_is_a_400_naming_vllm_xargs():
    request = decode(CompletionRequest, {"prompt": "hi", "vllm_xargs": {"big": 2**70}})
    with pytest.raises(ApiError) as info:
        sampling_params(request, max_tokens=4, logprobs=None)
    assert info.value.status == 400 and info.value.param == "vllm_xargs"
    assert info.value.message.startswith("vllm_xargs must hold only msgpack-encodable values")


def test_engine_fields_of_extra_args_are_named_by_their_http_parameter():
    assert [http_param(f) for f in ("extra_args", "extra_args.ids", "extra_args[0]", "prompt", None)] == \
        ["vllm_xargs", "vllm_xargs.ids", "vllm_xargs[0]", "prompt", None]
    refused = from_engine_error(RequestError("ids must be a list", field="extra_args.ids", source="logits processor m:P"))
    assert (refused.status, refused.param) == (400, "vllm_xargs.ids")
    assert refused.message == "logits processor m:P refused vllm_xargs.ids: ids must be a list"
    plain = from_engine_error(RequestError("bad prompt", field="prompt"))
    assert (plain.message, plain.param) == ("bad prompt", "prompt")


def test_io_process_body_requires_data_and_refuses_stream():
    with pytest.raises(ApiError) as missing:
        decode(IOProcessRequest, {"max_tokens": 3})
    assert missing.value.param == "data" and missing.value.code == "missing_parameter"
    with pytest.raises(ApiError) as unknown:
        decode(IOProcessRequest, {"data": 1, "prompt": "x"})
    assert unknown.value.param == "prompt" and unknown.value.code == "unsupported_parameter"
    streamed = decode(IOProcessRequest, {"data": 1, "stream": True})
    assert [param for param, _ in streamed.unsupported()] == ["stream"]
    request = decode(IOProcessRequest, {"data": [1, "two"]})
    assert request.data == [1, "two"] and request.max_tokens == 16


# --- choosing the IO processor --------------------------------------------------------------------------


class Echo(IOProcessor):
    pass


class BrokenConstructor(IOProcessor):
    def __init__(self, engine_config=None):
        raise RuntimeError("no configuration file")


def test_no_name_chooses_none_and_a_name_builds_its_class_with_the_config():
    config = EngineConfig()
    assert select_io_processor(config, {"echo": Echo}).processor is None
    config = EngineConfig(io_processor_plugin="echo")
    setup = select_io_processor(config, {"echo": Echo})
    assert setup.name == "echo" and isinstance(setup.processor, Echo) and setup.processor.engine_config is config


def test_a_name_nothing_installs_is_a_config_error_saying_what_is_installed():
    with pytest.raises(ConfigError) as info:  # this environment installs no IO processor
        select_io_processor(EngineConfig(io_processor_plugin="nope"), {})
    assert info.value.field == "io_processor_plugin"
    assert str(info.value).startswith("--io-processor-plugin 'nope' is not an installed IO processor; none is "
                                      "installed: install a distribution with an entry point in the group "
                                      "asyncengine.io_processor_plugins")


def test_a_constructor_that_raises_fails_start_up_naming_the_plugin():
    with pytest.raises(StartupError, match=r"IO processor 'broken' \(test_io_process_and_xargs\.BrokenConstructor \(no installed distribution\)\) "
                                           r"failed in its constructor: RuntimeError: no configuration file"):
        select_io_processor(EngineConfig(io_processor_plugin="broken"), {"broken": BrokenConstructor})


# --- serving a request, against a fake engine -------------------------------------------------------------


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]


class FakeEngine:
    """Generates, for each prompt, its token ids reversed (so outputs can be matched to their prompts)."""

    tokenizer = FakeTokenizer()

    def __init__(self):
        self.submitted = []

    async def open_stream(self, prompt, params, request_id, *, add_special_tokens=True, final_only=False,
                          nowait=False):
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty", field="prompt")
        self.submitted.append((prompt, params.max_tokens, params.extra_args))
        return self._outputs(request_id, prompt if isinstance(prompt, str) else None, ids)

    async def _outputs(self, request_id, text, ids):
        yield RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, finished=True,
                            outputs=[CompletionOutput(index=0, text="out", token_ids=ids[::-1], finish_reason="stop")])


def context_with(processor, name="fake", installed=("fake",)):
    setup = IOProcessorSetup(name=name, processor=processor, installed=list(installed))
    return ServingContext(engine=FakeEngine(), model_name="m", max_model_len=64, io_processor=setup)


class Blocking(IOProcessor):
    """Plain methods that block: the server must run them in a thread (the loop guard fails the test if not)."""

    def pre_process(self, request):
        time.sleep(0.4)
        return [f"<{item}>" for item in request.data] + [[5, 6, 7], {"prompt_token_ids": [9]}, {"prompt": "p"}]

    def post_process(self, outputs):
        time.sleep(0.4)
        return {"prompts": [o.prompt for o in outputs], "generated": [o.outputs[0].token_ids for o in outputs]}


class Awaiting(IOProcessor):
    async def pre_process(self, request):
        return "one prompt"

    async def post_process(self, outputs):
        return [len(outputs)]


@pytest.mark.anyio
async def test_sync_plugins_run_in_a_thread_and_outputs_come_back_in_prompt_order():
    context = context_with(Blocking())
    request = decode(IOProcessRequest, {"data": ["a", "b"], "max_tokens": 3, "vllm_xargs": {"k": 1}})
    response = await create_io_process(context, request, "req")
    data = msgspec.json.decode(msgspec.json.encode(response))
    assert data["plugin"] == "fake" and data["object"] == "io_process" and data["id"] == "ioproc-req"
    assert data["data"]["prompts"] == ["<a>", "<b>", None, None, "p"]
    assert data["data"]["generated"] == [FakeTokenizer().encode("<a>")[::-1], FakeTokenizer().encode("<b>")[::-1],
                                         [7, 6, 5], [9], FakeTokenizer().encode("p")]
    assert [(tokens, xargs) for _, tokens, xargs in context.engine.submitted] == [(3, {"k": 1})] * 5
    assert data["usage"]["prompt_tokens"] == data["usage"]["completion_tokens"] == 3 + 3 + 3 + 1 + 1


@pytest.mark.anyio
async def test_async_plugins_are_awaited():
    response = await create_io_process(context_with(Awaiting()), decode(IOProcessRequest, {"data": None}), None)
    assert msgspec.json.decode(msgspec.json.encode(response))["data"] == [1]


class Faulty(IOProcessor):
    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def pre_process(self, request):
        if self.fault == "refuse":
            raise RequestError("items must be strings", field="data.items")
        if self.fault == "value":
            raise ValueError("too many items")
        if self.fault == "bug":
            return request.data["missing"]
        if self.fault == "not prompts":
            return 42
        if self.fault == "bad prompt":
            return ["fine", {"text": "no"}]
        if self.fault == "empty prompt":
            return ["fine", []]
        return ["fine"]

    async def post_process(self, outputs):
        if self.fault == "post bug":
            raise RuntimeError("lost the outputs")
        if self.fault == "not json":
            return {"value": object()}
        return "ok"


@pytest.mark.anyio
@pytest.mark.parametrize("fault, status, param, code, message", [
    ("refuse", 400, "data.items", "io_processor_refused",
     "IO processor 'fake' (pre_process) refused the request: RequestError: items must be strings"),
    ("value", 400, "data", "io_processor_refused",
     "IO processor 'fake' (pre_process) refused the request: ValueError: too many items"),
    ("bug", 500, None, "io_processor_error", "IO processor 'fake' (pre_process) failed: TypeError: "),
    ("not prompts", 500, None, "io_processor_error", "IO processor 'fake' (pre_process) returned int, not a prompt"),
    ("bad prompt", 500, None, "io_processor_error", "IO processor 'fake' (pre_process) returned {'text': 'no'} as "
                                                    "prompt 1"),
    ("empty prompt", 400, "prompt", "invalid_value", "prompt 1 that IO processor 'fake' built: the prompt is empty"),
    ("post bug", 500, None, "io_processor_error",
     "IO processor 'fake' (post_process) failed: RuntimeError: lost the outputs"),
    ("not json", 500, None, "io_processor_error",
     "IO processor 'fake' (post_process) returned a value that cannot be encoded as JSON: TypeError"),
])
async def test_what_a_plugin_raises_answers_that_request_only_naming_the_plugin(fault, status, param, code, message,
                                                                                   caplog):
    processor = Faulty(fault)
    context = context_with(processor)
    request = decode(IOProcessRequest, {"data": ["x"]})
    with pytest.raises(ApiError) as info:
        await create_io_process(context, request, None)
    error = info.value
    assert (error.status, error.param, error.code) == (status, param, code)
    # What the plugin's code raised names its class and distribution (interfaces/plugin_code.py), then the hook;
    # what the server found wrong in a hook's result names the hook.
    named = message if "returned" in message and "JSON" not in message else re.sub(r"^IO processor 'fake' \((\w+)\) ",
                   r"IO processor 'fake' (test_io_process_and_xargs.Faulty (no installed distribution)) \1 ", message)
    assert error.message.startswith(named), error.message
    assert error.type == ("internal_error" if status == 500 else "invalid_request_error")
    # A plugin's bug (an exception other than a refusal) is logged with its traceback; a refusal is not.
    logged = [r for r in caplog.records if r.getMessage().startswith("IO processor 'fake' failed")]
    assert bool(logged) == (fault in ("bug", "post bug")) and all(r.exc_info for r in logged)
    processor.fault = None  # the next request is served
    response = await create_io_process(context, request, None)
    assert msgspec.json.decode(msgspec.json.encode(response))["data"] == "ok"


@pytest.mark.anyio
async def test_a_server_without_an_io_processor_says_how_to_choose_one():
    context = ServingContext(engine=FakeEngine(), model_name="m", max_model_len=64,
                             io_processor=IOProcessorSetup(installed=["ae_example_items"]))
    with pytest.raises(ApiError) as info:
        await create_io_process(context, decode(IOProcessRequest, {"data": 1}), None)
    assert (info.value.status, info.value.code) == (400, "io_processor_not_configured")
    assert info.value.message == ("this server has no IO processor: start it with --io-processor-plugin NAME "
                                  "(installed IO processors: ae_example_items)")


# --- a logits processor's refusal, from the frontend's InputProcessor to the HTTP error -------------------


class NeedsList(LogitsProcessor):
    @classmethod
    def validate_params(cls, params):
        value = (params.extra_args or {}).get("ids", [])
        if not isinstance(value, list):
            raise RequestError("ids must be a list", field="extra_args.ids")


def test_a_processors_refusal_names_the_processor_and_the_vllm_xargs_path():
    config = ModelConfig(model_dir="x", tokenizer_dir=None, served_model_name="m", architectures=["LlamaForCausalLM"],
                         hf_config={}, dtype="float32", max_model_len=64, vocab_size=100, eos_token_ids=[2],
                         generation_defaults={})
    processor = InputProcessor(EngineConfig(), config, None, [NeedsList])
    request = decode(CompletionRequest, {"prompt": [5, 6], "vllm_xargs": {"ids": "7"}})
    params = sampling_params(request, max_tokens=4, logprobs=None)
    with pytest.raises(RequestError) as info:
        processor.process("r", {"prompt_token_ids": [5, 6]}, params)
    assert info.value.message == "ids must be a list"  # the processor's own words, for LLM users as they are
    error = from_engine_error(info.value)
    assert (error.status, error.param) == (400, "vllm_xargs.ids")
    assert error.message == ("logits processor test_io_process_and_xargs:NeedsList refused vllm_xargs.ids: "
                             "ids must be a list")
    ok = decode(CompletionRequest, {"prompt": [5, 6], "vllm_xargs": {"ids": [7]}})
    assert processor.process("r2", {"prompt_token_ids": [5, 6]}, sampling_params(
        ok, max_tokens=4, logprobs=None)).children
