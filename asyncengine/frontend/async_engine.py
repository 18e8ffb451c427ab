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

Stat loggers (the stat-logger plugins, and any added with `add_stat_logger`) get every step's
scheduler and iteration stats in `record`, and a `log()` call every `stats_log_interval` seconds. A
stat logger that raises is a bug that would otherwise leave the metrics silently wrong, so the engine
stops serving with an EngineDeadError naming it.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.from_thread import run_sync as run_on_loop
from anyio.lowlevel import current_token

from asyncengine.config.engine import EngineConfig, config_from_dict
from asyncengine.runtime.reply import Reply
from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError, StartupError, rebuild_error
from asyncengine.frontend.admission import AdmissionGate
from asyncengine.frontend.core_client import CoreClient, start_core_client
from asyncengine.frontend.iteration_stats import IterationStats, StatsTracker
from asyncengine.frontend.output_collector import OutputCollector
from asyncengine.frontend.output_processor import OutputKind, OutputProcessor
from asyncengine.frontend.processor import InputProcessor, ProcessedRequest
from asyncengine.frontend.startup import FrontendSetup, prepare_async
from asyncengine.frontend.stat_loggers import StatLoggerBase, build_stat_logger, call_record, engine_initialized
from asyncengine.frontend.tokenizer import decode_ids, encode_text, render_chat
from asyncengine.frontend.tokenizer_pool import TokenizerPool
from asyncengine.outputs import RequestOutput
from asyncengine.plugin_runtime.phases import PluginState, run_plugin_phases
from asyncengine.plugin_runtime.placement import frontend_roles
from asyncengine.plugin_runtime.records import StartupRecord, StartupTrace, write_trace
from asyncengine.runtime.groups import single_exceptions
from asyncengine.sampling_params import SamplingParams
from asyncengine.wire.engine_core import EngineCoreOutputs, SchedulerStats
from asyncengine.wire.messages import AbortRequests, AddRequests, EngineCoreDead, UtilityCall, UtilityResult

logger = logging.getLogger(__name__)


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
        self.chat_template = setup.chat_template
        self.processor = InputProcessor(config, setup.model_config, setup.tokenizer, plugins.logits_processors)
        # Tokenizing and chat rendering run here, off the event loop (tokenizer_pool.py).
        self.tokenizer_pool = TokenizerPool()
        self.output_processor = OutputProcessor(setup.tokenizer)
        self._core = core
        self._collectors: dict[str, OutputCollector] = {}
        self._gate = AdmissionGate(config.max_waiting_requests)
        self._waiting: dict[str, str] = {}  # engine-core request id -> its request, until admitted
        self._in_core: set[str] = set()  # engine-core request ids sent and not yet finished
        self._calls: dict[int, Reply] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._accepting = True
        self._closing = False
        self.last_scheduler_stats: SchedulerStats | None = None
        # Stat loggers: a tuple replaced as a whole, so a step iterates a stable snapshot. The tracker
        # is fed only while there is a logger: without one, stats cost nothing.
        self._stat_loggers: tuple[StatLoggerBase, ...] = ()
        self._stats = StatsTracker()
        # `record` calls never overlap (a step's and the idle flush's). Taken without a checkpoint when
        # free, so recording a step lets no other task run before a synchronous `record` is done.
        self._stats_lock = anyio.Lock(fast_acquire=True)
        self._logging_stats = False
        self._task_group: TaskGroup | None = None
        # Where the engine runs, so that add_stat_logger can be called from other threads (LLM's users).
        self._loop_thread = threading.get_ident()
        self._loop_token = current_token()

    # -- life cycle ------------------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, **options: Any) -> AsyncIterator["AsyncEngine"]:
        """Start an engine; `config` or keyword options (EngineConfig fields), not both."""
        if config is None:
            config = config_from_dict(options)
        elif options:
            raise TypeError("pass an EngineConfig or keyword options, not both")
        trace = StartupTrace("frontend")
        try:
            plugins = await run_plugin_phases(frontend_roles(config), config, trace)
            config = plugins.config
            async with trace.phase("model"):
                setup = await prepare_async(config, plugins.platform)
            with single_exceptions():
                async with anyio.create_task_group() as tg:
                    async with trace.phase("engine core"):
                        core = await start_core_client(config)(config, setup, tg, plugins, trace)
                    async with trace.phase("ready"):
                        engine = cls(config, setup, core, plugins, trace.records)
                        engine._task_group = tg
                        for stat_logger in _plugin_stat_loggers(plugins.stat_loggers, config):
                            engine.add_stat_logger(stat_logger)
                            await _logger_initialized(stat_logger)
                    tg.start_soon(engine._handle_outputs)
                    if config.startup_trace:  # now, for a server that runs for days; again at the end
                        write_trace(config.startup_trace, trace.records)
                    try:
                        yield engine
                    finally:
                        await engine._close()
                        tg.cancel_scope.cancel()
        finally:
            if config.startup_trace:  # also when the start failed: the records say where
                write_trace(config.startup_trace, trace.records)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._accepting

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    async def shutdown(self, grace_period: float = 30.0) -> None:
        """Stop admitting requests, let running ones finish for up to `grace_period` seconds, abort the rest."""
        self._accepting = False
        with anyio.move_on_after(grace_period):
            while self._collectors and self._dead is None:
                await anyio.sleep(0.05)
        for request_id in list(self._collectors):
            await self.abort(request_id)

    async def _close(self) -> None:
        self._accepting = False
        self._closing = True
        with anyio.CancelScope(shield=True):
            await self._core.close()
        self._fail_everything(EngineDeadError("the engine was shut down"))

    # -- requests --------------------------------------------------------------------------------------

    def process_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None) -> ProcessedRequest:
        """Validate and tokenize a request without queueing it (RequestError when it is bad). This tokenizes
        in the calling thread: on the event loop, use `await process_request_async(...)`."""
        return self.processor.process(self._new_request_id(request_id), prompt, params)

    async def process_request_async(self, prompt: Any, params: SamplingParams | None = None,
                                    request_id: str | None = None) -> ProcessedRequest:
        """`process_request`, with a text prompt tokenized in the tokenizer pool (off the event loop)."""
        request_id = self._new_request_id(request_id)
        text = _text_to_tokenize(prompt)
        if text is None or self.tokenizer is None:  # token ids (or no tokenizer, which it says): nothing slow
            return self.processor.process(request_id, prompt, params)
        return await self.tokenizer_pool.run(self._process_text, request_id, text, params)

    def _process_text(self, request_id: str, text: str, params: SamplingParams | None) -> ProcessedRequest:
        # In a pool thread. The checks of the ids run here too: they are as long as the prompt.
        token_ids = encode_text(self.tokenizer, text, add_special_tokens=True)
        return self.processor.process(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params)

    def _new_request_id(self, request_id: str | None) -> str:
        self._check_accepting()
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string", field="request_id")
        if request_id in self._collectors:
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
                          template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for a conversation through the chat template (`chat_template`, else the
        engine's, else the tokenizer's); see `tokenizer.render_chat` for the arguments. A bad
        conversation, or a template that fails on it, is a RequestError."""
        return await self.tokenizer_pool.run(
            render_chat, self.tokenizer, messages, chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, documents=documents, template_kwargs=template_kwargs,
        )

    async def chat_prompt(self, messages: list[dict[str, Any]], **render_options: Any) -> dict[str, Any]:
        """A conversation as a prompt: `{"prompt": text, "prompt_token_ids": ids}`, rendered and tokenized
        in the tokenizer pool. The template writes any BOS token itself, so none is added again."""
        text = await self.render_chat(messages, **render_options)
        return {"prompt": text, "prompt_token_ids": await self.tokenize(text, add_special_tokens=False)}

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
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield what is new for this request until it finishes (the last output has `finished`)."""
        processed = await self.process_request_async(prompt, params, request_id)
        async for output in self.submit(processed, OutputKind.DELTA, nowait=nowait):
            yield output

    async def submit(
        self, processed: ProcessedRequest, kind: OutputKind, *, nowait: bool = False
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue an already processed request and yield its outputs (deltas, or only the final one)."""
        request_id = processed.request_id
        num_children = len(processed.children)
        if num_children > self.config.max_waiting_requests:
            raise RequestError(
                f"n={num_children} exceeds max_waiting_requests ({self.config.max_waiting_requests})", field="n"
            )
        if request_id in self._collectors:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        # Registered before waiting for admission, so it can be aborted (and its id is taken) meanwhile.
        collector = OutputCollector()
        self._collectors[request_id] = collector
        self.output_processor.add_request(processed, kind)
        finished = False
        try:
            if nowait:
                if not self._gate.try_enter(num_children):
                    raise EngineOverloadedError(
                        f"{self.config.max_waiting_requests} requests are already waiting (max_waiting_requests); "
                        "retry later"
                    )
                admitted = True
            else:
                admitted = await self._gate.enter(num_children, lambda: self._collectors.get(request_id) is collector)
            if admitted and self._collectors.get(request_id) is not collector:
                self._gate.leave(num_children)  # aborted at the very moment it got in
            elif admitted:
                for child in processed.children:  # from here on, aborting the request gives the places back
                    self._waiting[child.request_id] = request_id
                self._check_accepting()
                self._in_core.update(child.request_id for child in processed.children)
                if self._stat_loggers:
                    self._stats.add_requests(processed.children)
                await self._core.send(AddRequests(requests=processed.children))
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._abort(request_id, notify=False)

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
        await self._abort(request_id, notify=True)

    async def _abort(self, request_id: str, *, notify: bool) -> None:
        collector = self._collectors.pop(request_id, None)
        if collector is None:
            return  # unknown, finished, or already aborted
        core_ids, final = self.output_processor.abort_request(request_id)
        self._leave_waiting(core_ids)
        if self._stat_loggers:
            self._stats.abort(core_ids, time.monotonic())
        if notify and final is not None:
            collector.put(final)
        self._gate.wake()  # it may be waiting for admission: let it see it was aborted
        sent = [core_id for core_id in core_ids if core_id in self._in_core]
        self._in_core.difference_update(core_ids)
        if sent and self._dead is None:
            try:
                await self._core.send(AbortRequests(request_ids=sent))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the engine core is gone: there is nothing left to abort

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down and accepts no new requests")

    def _leave_waiting(self, core_ids: list[str]) -> None:
        left = sum(1 for core_id in core_ids if self._waiting.pop(core_id, None) is not None)
        if left:
            self._gate.leave(left)

    # -- calls into the engine core and the workers -----------------------------------------------------

    async def collective_rpc(self, method: str, args: tuple | list = ()) -> list[Any]:
        """Run public worker method `method` on every rank; each rank's result (msgspec-encodable)."""
        return await self._call_core("collective_rpc", method, list(args))

    async def get_scheduler_stats(self) -> SchedulerStats:
        return msgspec.convert(await self._call_core("get_scheduler_stats"), SchedulerStats)

    async def reset_prefix_cache(self) -> None:
        await self._call_core("reset_prefix_cache")

    async def call_engine_core(self, method: str, *args: Any) -> Any:
        """A named engine-core call (`kv_cache_info`, `start_step_trace`, `stop_step_trace`, ...)."""
        return await self._call_core(method, *args)

    async def _call_core(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        call_id = next(self._call_ids)
        reply = self._calls[call_id] = Reply()
        try:
            await self._core.send(UtilityCall(call_id=call_id, method=method, args=list(args)))
            return await reply.wait()
        finally:
            self._calls.pop(call_id, None)

    # -- outputs ---------------------------------------------------------------------------------------

    async def _handle_outputs(self) -> None:
        while True:
            try:
                message = await self._core.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                if not self._closing:
                    self._die(EngineDeadError(f"{await self._core.death_cause()}"))
                return
            if isinstance(message, EngineCoreOutputs):
                await self._on_step(message)
            elif isinstance(message, UtilityResult):
                reply = self._calls.get(message.call_id)
                if reply is not None:
                    if message.error is not None:
                        reply.fail(rebuild_error(message.error_type, message.error, message.error_field))
                    else:
                        reply.set(message.result)
            elif isinstance(message, EngineCoreDead):
                self._die(EngineDeadError(f"{message.process}: {message.cause}"))
                return

    async def _on_step(self, message: EngineCoreOutputs) -> None:
        received = time.monotonic() if self._stat_loggers else 0.0
        self.last_scheduler_stats = message.scheduler_stats
        self._leave_waiting(message.admitted_request_ids)
        processed = self.output_processor.process_outputs(message.outputs)
        for output in processed.request_outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
            if output.finished:
                self._collectors.pop(output.request_id, None)
        for request_id, error in processed.failed_requests:  # a worker refused it: it alone fails
            collector = self._collectors.pop(request_id, None)
            if collector is not None:
                collector.fail(error)
        finished_core_ids = [o.request_id for o in message.outputs if o.finished]
        self._leave_waiting(finished_core_ids + processed.core_requests_to_abort)
        self._in_core.difference_update(finished_core_ids)
        self._in_core.difference_update(processed.core_requests_to_abort)
        if self._stat_loggers and self._dead is None:
            # Before this step's first await: a synchronous logger (Prometheus) has recorded the step
            # before any consumer wakes up to its outputs, so a finished request is already counted.
            iteration_stats = self._stats.step(
                message.outputs, received, stopped_in_frontend=processed.core_requests_to_abort
            )
            await self._record_stats(message.scheduler_stats, iteration_stats)
        if processed.core_requests_to_abort:
            await self._core.send(AbortRequests(request_ids=processed.core_requests_to_abort))

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            logger.error("engine dead: %s", error)
        self._fail_everything(self._dead)

    def _fail_everything(self, error: EngineDeadError) -> None:
        for collector in self._collectors.values():
            collector.fail(error)
        self._collectors.clear()
        for reply in self._calls.values():
            reply.fail(error)
        self._gate.fail(error)
        self._stats.clear()

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
        return self._stat_loggers

    def _add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._stat_loggers = (*self._stat_loggers, stat_logger)
        if not self._logging_stats and self._task_group is not None:
            self._logging_stats = True
            self._task_group.start_soon(self._log_stats_periodically)

    async def _record_stats(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        async with self._stats_lock:
            for stat_logger in self._stat_loggers:
                if self._dead is not None:
                    return
                try:
                    result = call_record(stat_logger, scheduler_stats, iteration_stats)  # ours or vLLM's signature
                    if inspect.isawaitable(result):
                        await result
                except Exception as exc:
                    await self._stat_logger_failed(stat_logger, "record", exc)
                    return

    async def _log_stats_periodically(self) -> None:
        """Every `stats_log_interval` seconds: report aborts an idle engine has not reported yet,
        then call each logger's `log()`. Runs in the engine's task group, so it ends with the engine."""
        while self._dead is None:
            await anyio.sleep(self.config.stats_log_interval)
            pending = self._stats.take_pending()
            if pending is not None and self._dead is None:
                await self._record_stats(self.last_scheduler_stats, pending)
            for stat_logger in self._stat_loggers:
                if self._dead is not None:
                    return
                try:
                    result = stat_logger.log()
                    if inspect.isawaitable(result):
                        await result
                except Exception as exc:
                    await self._stat_logger_failed(stat_logger, "log", exc)
                    return

    async def _stat_logger_failed(self, stat_logger: StatLoggerBase, method: str, exc: Exception) -> None:
        name = _qualified_name(type(stat_logger))
        logger.error("stat logger %s raised in %s()", name, method, exc_info=exc)
        error = EngineDeadError(f"stat logger {name} raised in {method}(): {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._die(error)
        # Nobody waits for the requests in the engine core any more: free what they hold there.
        in_core = list(self._in_core)
        self._in_core.clear()
        if in_core:
            try:
                await self._core.send(AbortRequests(request_ids=in_core))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the engine core is gone as well


def _text_to_tokenize(prompt: Any) -> str | None:
    """The text InputProcessor.process would tokenize in `prompt` (a text without token ids), if any."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


async def _logger_initialized(stat_logger: StatLoggerBase) -> None:
    try:
        await engine_initialized(stat_logger)
    except Exception as exc:  # the plugin's own failure, at start-up: named
        raise StartupError(f"stat logger plugin {_qualified_name(type(stat_logger))} raised in "
                           f"log_engine_initialized(): {type(exc).__name__}: {exc}") from exc


def _plugin_stat_loggers(classes: list[type], config: EngineConfig) -> list[StatLoggerBase]:
    """One instance of each stat-logger plugin class, built as `cls(config)`."""
    loggers = []
    for cls in classes:
        try:
            loggers.append(build_stat_logger(cls, config))
        except Exception as exc:
            raise StartupError(
                f"stat logger plugin {_qualified_name(cls)} raised when constructed: {type(exc).__name__}: {exc}"
            ) from exc
    return loggers
