"""vLLM's `EngineArgs` and its synchronous `LLMEngine`, over our AsyncEngine.

A plugin's test in vLLM's form builds an engine from arguments and drives it a step at a time:

    engine = LLMEngine.from_engine_args(EngineArgs(model=..., scheduler_cls=MyScheduler))
    engine.add_request("0", "foo", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        for output in engine.step(): ...

Here the engine runs on its own, in an event loop on a thread of its own (an anyio blocking portal, as
`LLM` does); each request's outputs are gathered as they come. `step()` returns, as vLLM's does, the
outputs of the requests that progressed since the previous call, each cumulative (the whole text and
token ids so far: vLLM's default output kind), waiting for the engine's next step when none has; a
request counts as unfinished until `step()` has returned its final output.

What `step()` raises when the engine dies: the plugin's own exception when the engine core runs in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, or unset: our default) and plugin code raised it -- the
same object, its type and message as vLLM's in-process engine raises it, with our `EngineDeadError`
(which names the culprit, the process and the phase) as an attribute `engine_dead_error` and a note
in its traceback. Otherwise (the engine core in a process of its own, or no exception behind the
death) the `EngineDeadError`, as vLLM's multiprocess engine raises one; its `cause_type` and
`cause_message` keep the original's type and message.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import anyio
from anyio.from_thread import start_blocking_portal

from asyncengine.config.engine import EngineConfig, config_from_dict
from asyncengine.errors import AsyncEngineError, EngineDeadError, raising_code
from asyncengine.frontend.async_engine import AsyncEngine
from asyncengine.frontend.output_processor import OutputKind
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import SamplingParams

# vLLM's switch for running the engine core in a process of its own; read as vLLM reads it.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class EngineArgs:
    """vLLM's `EngineArgs(model=..., **options)`: our EngineConfig's fields by their (vLLM) names. An
    option that is no EngineConfig field is a ConfigError naming it, when the engine is built."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.model = model
        self.options = options

    def create_engine_config(self) -> EngineConfig:
        options = dict(self.options)
        multiprocessing = os.environ.get(MULTIPROCESSING_ENV)
        if multiprocessing is not None and "in_process" not in options:
            options["in_process"] = multiprocessing.strip() in ("0", "false", "False")
        return config_from_dict({"model": self.model, **options})

    def __repr__(self) -> str:
        return f"EngineArgs(model={self.model!r}, {', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


AsyncEngineArgs = EngineArgs  # vLLM's name for the same arguments given to its async engine


class LLMEngine:
    """vLLM's synchronous engine: `add_request`, `step`, `has_unfinished_requests`, `abort_request`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._resources = ExitStack()
        try:
            self._portal = self._resources.enter_context(start_blocking_portal(backend="trio", name="asyncengine"))
            self.engine: AsyncEngine = self._resources.enter_context(
                self._portal.wrap_async_context_manager(AsyncEngine.start(config)))
        except BaseException:
            self._resources.close()
            raise
        self._finalizer = weakref.finalize(self, self._resources.close)
        # Touched on the portal's event loop only (add_request and step run their parts there).
        self._unfinished: set[str] = set()  # added, and their final output not yet returned by step()
        self._aborted: set[str] = set()
        self._updated: dict[str, RequestOutput] = {}  # cumulative, progressed since the previous step()
        self._latest: dict[str, RequestOutput] = {}
        self._failure: BaseException | None = None
        self._progress: anyio.Event | None = None  # what a waiting step() waits on (made on the event loop)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        if stat_loggers:
            raise TypeError("LLMEngine.from_engine_args(stat_loggers=...) is not taken here: install the "
                            "loggers as stat-logger plugins (docs/porting.md#stat-loggers)")
        return cls(engine_args.create_engine_config())

    # -- requests --------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None, **_vllm_only: Any) -> None:
        """Queue a request (a text prompt, `{"prompt": ...}` or `{"prompt_token_ids": [...]}`); a bad one
        raises here (RequestError), as in vLLM. vLLM's other keywords (priority, trace_headers, ...) are
        accepted and have no effect here."""
        processed = self._portal.call(self._add, request_id, prompt, params, lora_request)
        # In the portal's own task group: a request's follower lives as long as the engine does.
        self._portal.start_task_soon(self._follow, request_id, processed)

    async def _add(self, request_id: str, prompt: Any, params: SamplingParams | None, lora_request: Any) -> Any:
        if request_id in self._unfinished:
            raise ValueError(f"request id {request_id!r} is already running")
        processed = await self.engine.process_request_async(prompt, params, request_id, lora_request=lora_request)
        self._unfinished.add(request_id)
        self._aborted.discard(request_id)
        self._latest.pop(request_id, None)
        return processed

    async def _follow(self, request_id: str, processed: Any) -> None:
        try:
            async for delta in self.engine.submit(processed, OutputKind.DELTA):
                if request_id in self._aborted:
                    return
                self._updated[request_id] = self._latest[request_id] = _accumulate(self._latest.get(request_id),
                                                                                   delta)
                self._wake()
        except Exception as exc:  # given to the next step(), which raises it (see the module's docstring)
            if self._failure is None:
                self._failure = exc
            self._wake()

    def _wake(self) -> None:
        if self._progress is not None:
            self._progress.set()

    def step(self) -> list[RequestOutput]:
        """The outputs of the requests that progressed since the previous call (each cumulative); waits for
        progress while some request is unfinished. Raises what killed the engine (the module's docstring)."""
        return self._portal.call(self._step)

    async def _step(self) -> list[RequestOutput]:
        while not self._updated and self._failure is None and self._unfinished:
            self._progress = anyio.Event()
            await self._progress.wait()
        if self._failure is not None:
            raise _as_vllm_raises(self._failure)
        outputs = list(self._updated.values())
        self._updated.clear()
        for output in outputs:
            if output.finished:
                self._unfinished.discard(output.request_id)
                self._latest.pop(output.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; step() returns nothing more of them."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._portal.call(self._abort, ids)

    async def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._unfinished:
                self._aborted.add(request_id)
                self._unfinished.discard(request_id)
                self._updated.pop(request_id, None)
                self._latest.pop(request_id, None)
                await self.engine.abort(request_id)

    # -- the engine --------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._portal.call(self.engine.collective_rpc, method, timeout, args, kwargs)

    def shutdown(self) -> None:
        """Shut the engine down (its processes and threads included); also at garbage collection."""
        if self._finalizer.detach() is not None:
            self._resources.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _accumulate(previous: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """`previous` (cumulative) with `delta` (what is new) added: vLLM's CUMULATIVE output kind."""
    if previous is None:
        return RequestOutput(request_id=delta.request_id, prompt=delta.prompt,
                             prompt_token_ids=list(delta.prompt_token_ids),
                             outputs=[_copy(completion) for completion in delta.outputs], finished=delta.finished,
                             num_cached_tokens=delta.num_cached_tokens)
    by_index = {completion.index: completion for completion in previous.outputs}
    for new in delta.outputs:
        old = by_index.get(new.index)
        if old is None:
            by_index[new.index] = _copy(new)
            continue
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + list(new.logprobs)
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    return RequestOutput(request_id=previous.request_id, prompt=previous.prompt,
                         prompt_token_ids=previous.prompt_token_ids,
                         outputs=[by_index[index] for index in sorted(by_index)], finished=delta.finished,
                         num_cached_tokens=delta.num_cached_tokens or previous.num_cached_tokens)


def _copy(completion: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(index=completion.index, text=completion.text, token_ids=list(completion.token_ids),
                            logprobs=None if completion.logprobs is None else list(completion.logprobs),
                            cumulative_logprob=completion.cumulative_logprob,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _as_vllm_raises(failure: BaseException) -> BaseException:
    """What step() raises for `failure` (the module's docstring): the plugin's exception itself when it is
    here, else `failure`."""
    cause = failure.__cause__
    if (isinstance(failure, EngineDeadError) and isinstance(cause, Exception)
            and not isinstance(cause, AsyncEngineError) and raising_code(cause) is not None):
        if getattr(cause, "engine_dead_error", None) is None:
            cause.engine_dead_error = failure  # type: ignore[attr-defined]
            cause.add_note(f"asyncengine: {failure}")
        return cause
    return failure
