"""AsyncEngine: the engine for async applications, on anyio (trio or asyncio).

    async with AsyncEngine.start(EngineConfig(...)) as engine:
        async for output in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(output.outputs[0].text, end="")

`AsyncEngine.start` owns a task group: the engine core (in this event loop, or in its own process)
and the output handler run in it, and leaving the `async with` shuts them down. Each output carries
what is new since the previous one. A request is aborted, and its KV blocks freed, when its consumer
stops: `abort(request_id)`, cancellation, closing the generator, or leaving `stream(...)`.

Tokenizing and chat rendering never run on the event loop: `generate` (and `process_request_async`,
`tokenize`, `detokenize`, `render_chat`, `chat_prompt`, which the server calls) run them in the
engine's `tokenizer_pool`, a few threads that the server and the Python API share (tokenizer_pool.py).

Each request, a generation or a pooling request (`encode`, `pool`: frontend/pooling.py), is one
RequestRecord (request_state.py) from `submit` to its end, in one RequestTable that makes submitting,
aborting, a step's outputs and the engine's death one call each, whatever the kind; every request runs
through `_run` (admission, hand-over, outputs, and the one abort path). The server hands a generation
over once, through `open_stream` (the parsed prompt or conversation, its SamplingParams and options:
rendered, tokenized and validated here, the output stream returned). Calls into the engine core and
the workers (`collective_rpc`, `get_scheduler_stats`, ...) go through the CoreClient (core_client.py).

Stat loggers (the stat-logger plugins, and any added with `add_stat_logger`) run in StatLogging
(stat_logging.py): a slow one cannot stall the streams. A stat logger that raises is a bug that
would otherwise leave the metrics silently wrong, so the engine stops serving with an
EngineDeadError naming it. `wait_dead()` returns once the engine has died.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.from_thread import run_sync as run_on_loop
from anyio.lowlevel import current_token

from asyncengine.config.engine import EngineConfig, config_from_dict
from asyncengine.errors import EngineDeadError, RequestError
from asyncengine.frontend.chat_images import image_placeholders, load_chat_images
from asyncengine.frontend.core_client import CoreClient
from asyncengine.frontend.dp_router import EngineLost, start_client
from asyncengine.frontend.output_processor import OutputKind, OutputProcessor
from asyncengine.frontend.pooling import PoolingProcessor, PoolingPrompt
from asyncengine.frontend.processor import InputProcessor, ProcessedRequest
from asyncengine.frontend.request_state import RequestRecord, RequestTable
from asyncengine.frontend.startup import FrontendSetup, prepare_async
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.frontend.stat_logging import StatLogging, logger_initialized
from asyncengine.frontend.stat_logging import plugin_stat_loggers as _plugin_stat_loggers  # (tests build plugins)
from asyncengine.frontend.tokenizer import decode_ids, encode_text, render_chat
from asyncengine.frontend.tokenizer_pool import TokenizerPool
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.pooling.outputs import PoolingRequestOutput
from asyncengine.pooling.params import PoolingParams
from asyncengine.plugin_runtime.phases import PluginState, run_plugin_phases
from asyncengine.plugin_runtime.placement import frontend_roles
from asyncengine.wire.startup import StartupRecord
from asyncengine.plugin_runtime.records import StartupTrace, write_trace
from asyncengine.runtime.groups import single_exceptions
from asyncengine.sampling_params import SamplingParams
from asyncengine.wire.engine_core import EngineCoreOutputs, SchedulerStats
from asyncengine.wire.messages import AbortRequests, AddRequests, EngineCoreDead

logger = logging.getLogger(__name__)



@asynccontextmanager
async def frontend_start(
    config: EngineConfig | None, options: dict[str, Any], roles: Callable[[EngineConfig], set[str]], *,
    endpoint_tasks: tuple[str, ...] | None = None,
) -> AsyncIterator[tuple[EngineConfig, PluginState, FrontendSetup, StartupTrace]]:
    """The start-up both clients share (AsyncEngine's, the render server's RenderClient's): the config from
    `config` or keyword options (not both), the plugin phases for `roles(config)`, then the model's config
    and tokenizer. Gives (config as the plugins left it, their state, the setup, the trace); the trace is
    written at the end, also when the start failed (the records say where)."""
    if config is None:
        config = config_from_dict(options)
    elif options:
        raise TypeError("pass an EngineConfig or keyword options, not both")
    trace = StartupTrace("frontend")
    try:
        plugins = await run_plugin_phases(roles(config), config, trace, endpoint_tasks=endpoint_tasks)
        config = plugins.config
        async with trace.phase("model"):
            setup = await prepare_async(config, plugins.platform)
        yield config, plugins, setup, trace
    finally:
        if config.startup_trace:
            write_trace(config.startup_trace, trace.records)

class AsyncEngine:
    def __init__(self, config: EngineConfig, setup: FrontendSetup, core: CoreClient, plugins: PluginState,
                 startup_records: list[StartupRecord]) -> None:
        self.config = config
        self.plugins = plugins
        self.platform = plugins.platform
        # The start-up report: every process's records (GET /v1/startup, `plugins timeline --trace`).
        self.startup_report = startup_records
        self.model_config = setup.model_config
        self.tokenizer = setup.tokenizer
        # Image processing (frontend/multimodal.py; None: no images), and the processor's chat template as fallback.
        self.multimodal = setup.multimodal
        self.chat_template = setup.chat_template or (self.multimodal.chat_template if self.multimodal else None)
        self.processor = InputProcessor(config, setup.model_config, setup.tokenizer, plugins.logits_processors,
                                        multimodal=setup.multimodal)
        self.lora_adapters = self.processor.lora  # adapters by name, and the resolvers (frontend/lora.py)
        self.startup_report.append(self.lora_adapters.startup_record("frontend"))
        # Tokenizing and chat rendering run here, off the event loop (tokenizer_pool.py); images are decoded and
        # processed in a pool of their own, so that a burst of large images never holds up text requests.
        self.tokenizer_pool = TokenizerPool()
        self.media_pool = TokenizerPool()
        self._core = core
        self.stat_logging = StatLogging(config.stats_log_interval, self._stat_logger_failed,
                                        lambda: self.last_scheduler_stats)
        # Every request, of every kind: generations (their outputs made by the output processor) and
        # pooling requests (checked and made by the pooling processor).
        self._requests = RequestTable(config.max_waiting_requests, self.stat_logging.tracker,
                                      lambda: self.stat_logging.active)
        self.output_processor = OutputProcessor(setup.tokenizer)
        self._pooling = PoolingProcessor(config, setup.model_config, setup.tokenizer)
        self._request_ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._lost_engines: set[int] = set()  # data-parallel engine cores that died while others serve on
        self._died = anyio.Event()
        self._accepting = True
        self._closing = False
        self.last_scheduler_stats: SchedulerStats | None = None
        # Where the engine runs, so that add_stat_logger can be called from other threads (LLM's users).
        self._loop_thread = threading.get_ident()
        self._loop_token = current_token()

    # -- life cycle ------------------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, **options: Any) -> AsyncIterator["AsyncEngine"]:
        """Start an engine; `config` or keyword options (EngineConfig fields), not both."""
        async with frontend_start(config, options, frontend_roles) as (config, plugins, setup, trace):
            with single_exceptions():
                async with anyio.create_task_group() as tg:
                    async with trace.phase("engine core"):
                        core = await tg.start(start_client(config), config, setup, plugins, trace)
                    async with trace.phase("ready"):
                        engine = cls(config, setup, core, plugins, trace.records)
                        await tg.start(engine.stat_logging.run)
                        for stat_logger in _plugin_stat_loggers(plugins.stat_loggers, config):
                            engine.add_stat_logger(stat_logger)
                            await logger_initialized(stat_logger)
                    await tg.start(engine._handle_outputs)
                    if config.startup_trace:  # now, for a server that runs for days; again at the end
                        write_trace(config.startup_trace, trace.records)
                    try:
                        yield engine
                    finally:
                        await engine._close()
                        tg.cancel_scope.cancel()

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._accepting

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def dead_engine_indexes(self) -> list[int]:
        """The engine cores (data-parallel indexes) that have died: those lost while others serve on, or all
        of them once the engine is dead (/metrics' engine_up)."""
        if self._dead is not None:
            return list(range(self.config.data_parallel_size))
        return sorted(self._lost_engines)

    async def wait_dead(self) -> EngineDeadError:
        """Wait until the engine dies (its engine core or a worker gone, a stat logger failed); the
        error its requests got. A shutdown is not a death: this keeps waiting."""
        await self._died.wait()
        return self._dead if self._dead is not None else EngineDeadError("the engine died")  # set before the event

    async def shutdown(self, grace_period: float = 30.0) -> None:
        """Stop admitting requests, let running ones finish for up to `grace_period` seconds, abort the rest."""
        self._accepting = False
        with anyio.move_on_after(grace_period):
            await self._requests.wait_empty()  # also when the engine dies: its requests fail at once
        for request_id in self._requests.request_ids():
            await self.abort(request_id)

    async def _close(self) -> None:
        self._accepting = False
        self._closing = True
        with anyio.CancelScope(shield=True):
            await self._core.close()
        self._requests.fail_all(EngineDeadError("the engine was shut down"))
        self._core.fail_calls(EngineDeadError("the engine was shut down"))

    # -- requests --------------------------------------------------------------------------------------

    def process_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                        lora_request: LoRARequest | None = None, priority: int = 0) -> ProcessedRequest:
        """Validate and tokenize a request without queueing it (RequestError when it is bad). This tokenizes
        in the calling thread: on the event loop, use `await process_request_async(...)`."""
        return self.processor.process(self._new_request_id(request_id), prompt, params, lora_request, priority)

    async def process_request_async(self, prompt: Any, params: SamplingParams | None = None,
                                    request_id: str | None = None,
                                    lora_request: LoRARequest | None = None,
                                    priority: int = 0) -> ProcessedRequest:
        """`process_request`, with a text prompt tokenized in the tokenizer pool (off the event loop)."""
        request_id = self._new_request_id(request_id)
        if lora_request is not None:  # its adapter's config is read off the loop (then remembered)
            await self.lora_adapters.check_off_loop(lora_request)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:  # images: decoded, processed
            return await self.media_pool.run(self.processor.process, request_id, prompt, params, lora_request,
                                             priority)
        text = _text_to_tokenize(prompt)
        if self.tokenizer is None:  # token ids only (the processor says so for text): nothing slow
            return self.processor.process(request_id, prompt, params, lora_request, priority)
        if text is None:  # token ids: nothing slow, unless bad_words are to be tokenized or a grammar parsed
            if params is None or not (params.bad_words or params.structured_outputs is not None):
                return self.processor.process(request_id, prompt, params, lora_request, priority)
            return await self.tokenizer_pool.run(self.processor.process, request_id, prompt, params, lora_request,
                                                 priority)
        return await self.tokenizer_pool.run(self._process_text, request_id, text, params, lora_request, priority,
                                             prompt.get("cache_salt") if isinstance(prompt, dict) else None)

    def _process_text(self, request_id: str, text: str, params: SamplingParams | None,
                      lora_request: LoRARequest | None = None, priority: int = 0,
                      cache_salt: str | None = None) -> ProcessedRequest:
        # In a pool thread. The checks of the ids run here too: they are as long as the prompt.
        token_ids = encode_text(self.tokenizer, text, add_special_tokens=True)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return self.processor.process(request_id, prompt, params, lora_request, priority)

    def _new_request_id(self, request_id: str | None) -> str:
        self._check_accepting()
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string", field="request_id")
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        return request_id

    # -- tokenizing and chat rendering, in the tokenizer pool ---------------------------------------------

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text` (RequestError without a tokenizer)."""
        tokenizer = self._require_tokenizer("tokenizing text")
        if not isinstance(text, str):
            raise RequestError(f"only text can be tokenized, got {type(text).__name__}", field="prompt")
        return await self.tokenizer_pool.run(encode_text, tokenizer, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (RequestError without a tokenizer, or for an id outside the vocabulary)."""
        tokenizer = self._require_tokenizer("detokenizing")
        return await self.tokenizer_pool.run(self._decode_checked, tokenizer, token_ids, skip_special_tokens)

    def _decode_checked(self, tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
        # In a pool thread: checking a million ids takes as long as decoding them.
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})", field="tokens")
        return decode_ids(tokenizer, list(token_ids), skip_special_tokens=skip_special_tokens)

    async def render_chat(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                          add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                          tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None, content_format: str | None = None) -> str:
        """The prompt text for a conversation through the chat template (`chat_template`, else the
        engine's, else the tokenizer's); see `tokenizer.render_chat` for the arguments (`content_format`
        None: the engine's chat_template_content_format). A bad conversation, or a template that fails
        on it, is a RequestError."""
        if self.multimodal is not None:  # image parts rendered as the placeholder, not loaded (chat_prompt loads them)
            messages = image_placeholders(messages)
        return await self.tokenizer_pool.run(
            render_chat, self.tokenizer, messages, chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, documents=documents, template_kwargs=template_kwargs,
            content_format=content_format or self.config.chat_template_content_format,
            image_placeholder=self.multimodal.chat_placeholder if self.multimodal is not None else None,
        )

    async def chat_prompt(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False,
                          **render_options: Any) -> dict[str, Any]:
        """A conversation as a prompt: `{"prompt": text, "prompt_token_ids": ids}`, rendered and tokenized
        in the tokenizer pool. The template writes any BOS token itself, so none is added again. With a
        multimodal model, the conversation's image parts are loaded (chat_images.py: fetched, decoded in the
        media pool) and processed there: the ids are the expanded prompt's and `mm_features` holds the images."""
        images: list[Any] = []
        if self.multimodal is not None:
            mm = self.multimodal
            messages, images = await load_chat_images(messages, mm.limits, mm.limit_per_prompt["image"],
                                                      self.media_pool.run)
        text = await self.render_chat(messages, **render_options)
        if not images or self.multimodal is None:
            return {"prompt": text, "prompt_token_ids": await self.tokenize(text, add_special_tokens=add_special_tokens)}
        token_ids, features = await self.media_pool.run(self.multimodal.process, text, None, images,
                                                        add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": features}

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise RequestError(f"{what} needs a tokenizer, but the engine runs with skip_tokenizer_init: send "
                               "token ids", field="prompt")
        return self.tokenizer

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        nowait: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield what is new for this request until it finishes (the last output has `finished`);
        `lora_request`: the LoRA adapter to run it with (docs/lora.md), None for the base model; `priority`:
        vLLM's (with --scheduling-policy priority, lower first); a dict prompt may carry `cache_salt`."""
        processed = await self.process_request_async(prompt, params, request_id, lora_request, priority)
        # Closed here when this generator is closed (an abort), not left to the garbage collector.
        async with aclosing(self.submit(processed, OutputKind.DELTA, nowait=nowait)) as outputs:
            async for output in outputs:
                yield output

    async def open_stream(
        self,
        prompt: str | list[int] | Mapping[str, Any] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        chat_options: Mapping[str, Any] | None = None,
        add_special_tokens: bool | None = None,
        final_only: bool = False,
        nowait: bool = False,
        lora_request: LoRARequest | None = None,
        group: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The one hand-over of a request from the server: a text prompt, a list of token ids, a prompt
        dict as `generate` takes it, or a conversation (`messages`, rendered through the chat template
        with `chat_options`, `render_chat`'s keyword arguments). `add_special_tokens` (when tokenizing
        text) defaults to True for a prompt, False for a conversation. Rendering and tokenizing run in the
        tokenizer pool; the request is validated here, now, raising RequestError (or EngineDeadError);
        the returned stream is not queued until it is iterated (so that several requests can be
        validated before any runs). It yields deltas, or only the final output when `final_only`;
        closing it aborts the request. `group` (from `request_group()`): requests opened with the same
        group share one request's share of the engine's slots (the prompts of one HTTP request). `priority`
        and `cache_salt`: vLLM's (docs/server.md, "Fields")."""
        if lora_request is not None:  # its adapter's config is read off the loop (then remembered)
            await self.lora_adapters.check_off_loop(lora_request)
        if messages is not None:
            if prompt is not None:
                raise TypeError("open_stream takes a prompt or messages, not both")
            # The template writes any BOS token itself: none is added unless asked for.
            prompt = await self.chat_prompt(messages, add_special_tokens=bool(add_special_tokens), **(chat_options or {}))
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        if isinstance(prompt, str):
            token_ids = await self.tokenize(prompt, add_special_tokens=add_special_tokens is not False)
            processed = self.process_request({"prompt": prompt, "prompt_token_ids": token_ids, **salt}, params,
                                             request_id, lora_request, priority)
        elif isinstance(prompt, list):
            processed = self.process_request({"prompt_token_ids": prompt, **salt}, params, request_id, lora_request,
                                             priority)
        else:
            if salt and isinstance(prompt, Mapping):
                prompt = {**prompt, **salt}
            processed = await self.process_request_async(prompt, params, request_id, lora_request, priority)
        if group is not None:
            processed.join_group(group)
        return self.submit(processed, OutputKind.FINAL_ONLY if final_only else OutputKind.DELTA, nowait=nowait)

    def request_group(self) -> str:
        """A new group for `open_stream(..., group=...)`: requests that count as one for fairness
        (docs/server.md, "Fairness")."""
        return self.processor.new_group_id()

    async def submit(
        self, processed: ProcessedRequest, kind: OutputKind, *, nowait: bool = False
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue an already processed request and yield its outputs (deltas, or only the final one)."""
        num_children = len(processed.children)
        if num_children > self.config.max_waiting_requests:
            raise RequestError(
                f"n={num_children} exceeds max_waiting_requests ({self.config.max_waiting_requests})", field="n"
            )
        record = self._requests.open(processed.request_id, processed.children,
                                     self.output_processor.new_state(processed, kind))
        async with aclosing(self._run(record, nowait=nowait)) as outputs:
            async for output in outputs:
                yield output

    async def _run(self, record: RequestRecord, *, nowait: bool) -> AsyncGenerator[Any, None]:
        """Any kind of request, opened in the table: admission (a place under max_waiting_requests, waited
        for unless `nowait`), the hand-over to the engine core, then its outputs until the last; if it ends
        otherwise (its consumer stopped, was cancelled, or an error), the one abort path."""
        finished = False
        try:
            if await self._requests.admit(record, nowait=nowait):
                self._check_accepting()
                await self._core.send(AddRequests(requests=self._requests.send(record)))
            while not finished:
                output = await record.next_output()
                finished = output.finished
                yield output
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._send_aborts(self._requests.abort(record, notify=False))

    @asynccontextmanager
    async def stream(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *, nowait: bool = False
    ) -> AsyncIterator[AsyncGenerator[RequestOutput, None]]:
        """`async with engine.stream(...) as outputs:`; leaving the block aborts an unfinished request."""
        outputs = self.generate(prompt, params, request_id, nowait=nowait)
        try:
            yield outputs
        finally:
            await outputs.aclose()

    async def abort(self, request_id: str) -> None:
        """Abort a request: its consumer gets a last output with finish_reason "abort"."""
        await self._send_aborts(self._requests.abort_by_id(request_id, notify=True))

    async def _send_aborts(self, core_ids: list[str]) -> None:
        """Abort these engine-core requests in the engine core (they hold KV blocks there)."""
        if core_ids and self._dead is None:
            try:
                await self._core.send(AbortRequests(request_ids=core_ids))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the engine core is gone: there is nothing left to abort

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise self._dead.again()
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down and accepts no new requests")

    # -- pooling requests (frontend/pooling.py) ----------------------------------------------------------

    def pooling_task_default(self) -> str:
        return self._pooling.pooling_task_default()

    def check_pooling_task(self, task: str) -> None:
        self._pooling.check_pooling_task(task)

    def prepare_pooling(self, prompt: Any, params: PoolingParams | None, *, task: str | None = None,
                        pair: Any = None, field: str = "prompt") -> PoolingPrompt:
        """Check and tokenize one pooling request (run it in the tokenizer pool: it may tokenize)."""
        return self._pooling.prepare_pooling(prompt, params, task=task, pair=pair, field=field)

    def check_fits_the_queue(self, count: int, field: str) -> None:
        self._pooling.check_fits_the_queue(count, field)

    async def pool(self, prompt: Any, pooling_params: PoolingParams | None = None, request_id: str | None = None,
                   *, task: str | None = None, pair: Any = None, field: str = "prompt",
                   nowait: bool = False) -> PoolingRequestOutput:
        """One pooling request, checked, tokenized (in the tokenizer pool) and run; its pooled output. It waits
        for a place under max_waiting_requests, or with `nowait` raises EngineOverloadedError when there is none."""
        self._check_accepting()
        prepared = await self.tokenizer_pool.run(
            self.prepare_pooling, prompt, pooling_params, task=task, pair=pair, field=field)
        return await self.run_pooling(prepared, request_id, nowait=nowait)

    async def run_pooling(self, prepared: PoolingPrompt, request_id: str | None = None, *,
                          nowait: bool = False) -> PoolingRequestOutput:
        self._check_accepting()
        record = self._requests.open(*self._pooling.new_request(prepared, request_id))
        async with aclosing(self._run(record, nowait=nowait)) as outputs:
            async for output in outputs:
                result: PoolingRequestOutput = output
                return result
        raise RequestError("the pooling request ended without an output")  # (_run yields until one is final)

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None = None, request_id: str | None = None,
                     *, task: str | None = None) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's AsyncLLM.encode: yields the request's one (final) PoolingRequestOutput."""
        yield await self.pool(prompt, pooling_params, request_id, task=task)

    # -- calls into the engine core and the workers (the core client's: core_client.py) --------------------

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] | list[Any] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run public worker method `method(*args, **kwargs)` on every rank; each rank's result. vLLM's
        signature (CoreClient.collective_rpc says what travels)."""
        return await self._core.collective_rpc(method, timeout, args, kwargs)

    async def get_scheduler_stats(self) -> SchedulerStats:
        return msgspec.convert(await self._core.call("get_scheduler_stats"), SchedulerStats)

    async def reset_prefix_cache(self) -> None:
        await self._core.call("reset_prefix_cache")

    async def call_engine_core(self, method: str, *args: Any) -> Any:
        """A named engine-core call (`kv_cache_info`, `start_step_trace`, `stop_step_trace`, ...)."""
        return await self._core.call(method, *args)

    # -- outputs ---------------------------------------------------------------------------------------

    async def _handle_outputs(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                message = await self._core.get_output()  # (a call's result goes to its caller there)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                if not self._closing:
                    self._die(EngineDeadError(f"{await self._core.death_cause()}"))
                return
            if isinstance(message, EngineCoreOutputs):
                await self._on_step(message)
            elif isinstance(message, EngineLost):  # one data-parallel engine core of several (dp_router.py)
                self._lost_engines.add(message.engine_index)
                self._requests.fail_core_requests(message.core_request_ids, message.error)
            elif isinstance(message, EngineCoreDead):
                dead = EngineDeadError(f"{message.process}: {message.cause}", cause_type=message.cause_type,
                                       cause_message=message.cause_message, culprit=message.culprit)
                dead.__cause__ = self._core.death_exception()  # the exception itself, when it was in this process
                self._die(dead)
                return

    async def _on_step(self, message: EngineCoreOutputs) -> None:
        logging_stats = self.stat_logging.active  # without a stat logger, stats cost nothing
        received = time.monotonic() if logging_stats else 0.0
        self.last_scheduler_stats = message.scheduler_stats
        to_abort = self._requests.on_step(message)
        if logging_stats:
            # Before this step's first await: a synchronous logger (Prometheus) has recorded the step
            # before any consumer wakes up to its outputs, so a finished request is already counted.
            await self.stat_logging.record_step(message, received, to_abort)
        if to_abort:
            await self._core.send(AbortRequests(request_ids=to_abort))

    def _die(self, error: EngineDeadError) -> list[str]:
        """The engine died: every request and call fails with `error`. The engine-core ids that were
        still in the engine core (to abort there, when the engine core itself is alive)."""
        if self._dead is None:
            self._dead = error
            logger.error("engine dead: %s", error)
        self.stat_logging.stop()
        in_core = self._requests.fail_all(self._dead)
        self._core.fail_calls(self._dead)
        self._died.set()
        return in_core

    # -- stat loggers ----------------------------------------------------------------------------------

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        """Give every step's stats to `stat_logger` from now on, and call its `log()` periodically.

        Requests already running when the first logger arrives are not counted. Safe to call from
        any thread: from another one (`llm.engine.add_stat_logger(...)` with the blocking LLM) it
        runs on the engine's event loop and returns once the logger is in place.
        """
        if not isinstance(stat_logger, StatLoggerBase):
            raise TypeError(f"add_stat_logger needs a StatLoggerBase instance, got {stat_logger!r}")
        if threading.get_ident() == self._loop_thread:
            self._add_stat_logger(stat_logger)
        else:
            run_on_loop(self._add_stat_logger, stat_logger, token=self._loop_token)

    @property
    def stat_loggers(self) -> tuple[StatLoggerBase, ...]:
        return self.stat_logging.loggers

    def _add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        if self._dead is not None:
            raise self._dead.again()
        self.stat_logging.add(stat_logger)

    async def _stat_logger_failed(self, error: EngineDeadError) -> None:
        in_core = self._die(error)
        # Nobody waits for the requests in the engine core any more: free what they hold there.
        await self._send_aborts_while_dying(in_core)

    async def _send_aborts_while_dying(self, core_ids: list[str]) -> None:
        if core_ids:
            try:
                await self._core.send(AbortRequests(request_ids=core_ids))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the engine core is gone as well


def _text_to_tokenize(prompt: Any) -> str | None:
    """The text InputProcessor.process would tokenize in `prompt` (a text without token ids), if any."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None
