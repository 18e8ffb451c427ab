"""The engine core's step loop, with async scheduling, and its handling of incoming messages.

With async scheduling the loop keeps two steps in the executor: while step N runs, it schedules and
submits step N+1, then folds in step N's sampled tokens when they arrive. Scheduling and output
handling thus overlap model execution instead of adding to it. Without it, one step at a time.
When step N+1 carries constrained requests whose token from step N is still in flight, and the
executor takes masks late, their masks follow the step: computed right after step N is folded in,
while N+1's forward pass runs (structured_output/deferred.py).

Requests, aborts and calls arrive on a task of their own and act on the scheduler between steps (one
event loop, so no locks). The outputs of one step travel as one message. If the executor reports a
dead worker, the loop sends `EngineCoreDead` naming it and stops.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from asyncengine.engine_core.core import EngineCore
from asyncengine.engine_core.executor import round_trip
from asyncengine.engine_core.micro_batches import steps_in_flight
from asyncengine.runtime.reply import Reply
from asyncengine.errors import EngineDeadError, RequestError, error_field, error_type_name
from asyncengine.structured_output.backend import GrammarError
from asyncengine.structured_output.deferred import DeferredMask
from asyncengine.wire.engine_core import EngineCoreOutputs, FinishReason
from asyncengine.wire.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreDead,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from asyncengine.wire.worker import SchedulerOutput, StepTimings

Send = Callable[[Any], Awaitable[None]]
logger = logging.getLogger(__name__)


class StepRecord(msgspec.Struct, array_like=True):
    """When one step was scheduled, ran on the worker and was folded in (time.monotonic seconds)."""

    step: int
    num_tokens: int
    schedule_start: float
    schedule_end: float
    execute_start: float
    execute_end: float
    update_start: float
    update_end: float
    # Inside the worker (wire.worker.StepTimings), -1 where it did not say: input preparation, forward
    # pass (host), sampling with the read-back, the forward pass on the device; and whether it was a
    # CUDA graph replay.
    prepare: float = -1.0
    forward: float = -1.0
    sample: float = -1.0
    device_forward: float = -1.0
    cuda_graph: bool = False


@dataclass
class _InFlight:
    step: int
    scheduler_output: SchedulerOutput
    reply: Reply
    schedule_start: float
    schedule_end: float
    deferred_mask: DeferredMask | None = None  # its grammar masks, set once the step before it is folded in


class EngineCoreLoop:
    def __init__(self, core: EngineCore, send: Send, *, process_name: str) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.executor = core.executor
        self.send = send
        self.process_name = process_name
        # 2 with async scheduling; P with micro-batches over P pipeline stages (micro_batches.py).
        self.pipeline_depth = steps_in_flight(core.engine_config, core.micro_batches)
        self.structured_output = core.structured_output
        self._wakeup = anyio.Event()
        self._num_steps = 0
        self._expert_tokens: list[int] | None = None  # the workers' tokens per expert (MoE models), last reported
        self._trace: list[StepRecord] | None = None
        self._phase = "step loop"  # what the step loop is doing, for the culprit of an exception
        self.death: EngineDeadError | None = None

    async def serve(self, inbox: AsyncIterator[Any]) -> None:
        """Run until `Shutdown`, the end of `inbox`, or a dead executor (reported with EngineCoreDead)."""
        async with anyio.create_task_group() as tg:
            # Grammar compiles (and the grammar-compile process) live as long as the step loop.
            await tg.start(self.structured_output.serve)
            tg.start_soon(self._read_inbox, inbox, tg)
            in_flight: deque[_InFlight] = deque()
            try:
                await self._step_loop(in_flight)
            except EngineDeadError as dead:
                await self._report_death(dead)
            except Exception as exc:  # a plugin's scheduler, or a bug in the core: every caller learns it, named
                logger.exception("the engine core's step loop failed")
                await self._report_death(EngineDeadError.from_exception(
                    f"{self.process_name}'s step loop", exc, process=self.process_name, phase=self._phase))
            finally:
                for step in in_flight:  # a worker waiting on masks that will not come is released
                    if step.deferred_mask is not None:
                        step.deferred_mask.cancel()
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.executor.shutdown()
                self.scheduler.shutdown()

    async def _report_death(self, dead: EngineDeadError) -> None:
        # In this process the exception itself stays reachable (the in-process client chains it).
        self.death = dead
        with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
            await self.send(EngineCoreDead(process=self.process_name, cause=str(dead), cause_type=dead.cause_type,
                                           cause_message=dead.cause_message, culprit=dead.culprit))

    # -- incoming messages -----------------------------------------------------------------------------

    async def _read_inbox(self, inbox: AsyncIterator[Any], tg: anyio.abc.TaskGroup) -> None:
        try:
            await self._handle_inbox(inbox, tg)
        except Exception as exc:  # a message the core cannot take is a bug: every caller learns it, named
            logger.exception("the engine core failed handling a message")
            await self._report_death(EngineDeadError.from_exception(
                self.process_name, exc, process=self.process_name, phase="handling a message from the frontend"))
        tg.cancel_scope.cancel()  # the frontend is done (or gone, or we died): stop stepping

    async def _handle_inbox(self, inbox: AsyncIterator[Any], tg: anyio.abc.TaskGroup) -> None:
        async for message in inbox:
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self.scheduler.add_request(request)
                    if request.sampling.structured_outputs is not None:
                        # Compiled off the step loop; the request waits in the scheduler meanwhile.
                        self.structured_output.track(request.request_id)
                        tg.start_soon(self._prepare_grammar, request)
                self._wakeup.set()
            elif isinstance(message, AbortRequests):
                self.scheduler.finish_requests(message.request_ids, FinishReason.ABORT)
                self._wakeup.set()
            elif isinstance(message, UtilityCall):
                tg.start_soon(self._utility, message)
            elif isinstance(message, Shutdown):
                break

    async def _prepare_grammar(self, request: Any) -> None:
        try:
            await self.structured_output.prepare(request.request_id, request.sampling.structured_outputs,
                                                 request.prompt_token_ids)
        except GrammarError as refused:  # the request alone fails, naming the field and the backend
            output = self.scheduler.fail_request(request.request_id, refused.message, refused.field)
            if output is not None:
                await self.send(EngineCoreOutputs(outputs=[output], scheduler_stats=self.scheduler.make_stats()))
        finally:
            self._wakeup.set()

    async def _utility(self, call: UtilityCall) -> None:
        try:
            result = await self._run_utility(call.method, call.args)
        except Exception as exc:  # the caller receives the error, typed and named; the engine goes on
            reply = UtilityResult(
                call_id=call.call_id, error=str(exc) or repr(exc), error_type=error_type_name(exc),
                error_field=error_field(exc),
            )
        else:
            reply = UtilityResult(call_id=call.call_id, result=result)
        await self.send(reply)

    async def _run_utility(self, method: str, args: list[Any]) -> Any:
        if method == "collective_rpc":  # the worker method, its arguments and its keyword arguments (or None)
            worker_method, worker_args, worker_kwargs = args
            return round_trip(await self.executor.call(worker_method, *worker_args, **(worker_kwargs or {})))
        if method == "get_structured_output_stats":
            return self.structured_output.stats_dict()
        if method == "get_scheduler_stats":
            stats = self.scheduler.make_stats()
            stats.expert_tokens = self._expert_tokens
            return round_trip(stats)
        if method == "reset_prefix_cache":
            return self.scheduler.reset_prefix_cache()
        if method == "kv_cache_info":
            manager = self.core.block_manager
            # Per KV cache group (one unless the model has sliding-window layers): its window and blocks in use.
            return {"num_blocks": manager.num_blocks, "num_free_blocks": manager.num_free_blocks,
                    "block_size": manager.block_size, "sliding_windows": list(manager.sliding_windows),
                    "group_blocks_in_use": list(manager.group_blocks_in_use)}
        if method == "start_step_trace":
            self._trace = []
            return True
        if method == "stop_step_trace":
            trace, self._trace = self._trace or [], None
            return round_trip(trace)
        raise RequestError(f"unknown engine-core call {method!r}", field="method")

    # -- the step loop ---------------------------------------------------------------------------------

    async def _step_loop(self, in_flight: deque[_InFlight]) -> None:
        # Masks may follow their step only with two steps in flight (not pipeline micro-batches, whose steps
        # alternate between batches) and an executor that takes them late.
        self.structured_output.deferred_masks = (
            self.pipeline_depth == 2 and self.core.micro_batches is None
            and getattr(self.executor, "supports_deferred_grammar", False))
        while True:
            # (has_requests: also a step of only finished ids once the last request ended, as vLLM sends it,
            # so that the workers forget them at once: a speculative draft's KV blocks go back with them.)
            while len(in_flight) < self.pipeline_depth and self.scheduler.has_requests():
                started = time.monotonic()
                self._phase = "step loop: scheduler.schedule()"
                scheduler_output = self.scheduler.schedule()
                scheduled = time.monotonic()
                if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
                    break
                self._phase = "step loop: executor.submit_step()"
                deferred_mask = None
                if scheduler_output.deferred_grammar_request_ids is not None:
                    deferred_mask = DeferredMask()
                    # (the keyword is not in Executor.submit_step's signature: only executors that say
                    # supports_deferred_grammar take it)
                    late_masks: Any = self.executor
                    reply = await late_masks.submit_step(scheduler_output, grammar=deferred_mask)
                else:
                    reply = await self.executor.submit_step(scheduler_output)
                in_flight.append(_InFlight(self._num_steps, scheduler_output, reply, started, scheduled,
                                           deferred_mask))
                self._num_steps += 1
            if not in_flight:
                if self.scheduler.has_unfinished_requests() and not self.structured_output.num_compiling:
                    raise EngineDeadError(
                        f"the scheduler ({type(self.scheduler).__qualname__}) holds "
                        f"{self.scheduler.get_num_unfinished_requests()} requests but can schedule none: this is "
                        "a bug in the scheduler"
                    )
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            step = in_flight.popleft()
            runner_output = await step.reply.wait()
            update_start = time.monotonic()
            self._phase = "step loop: scheduler.update_from_output()"
            outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
            if runner_output.expert_tokens is not None:  # the workers' totals, which the scheduler does not keep
                self._expert_tokens = runner_output.expert_tokens
            if outputs.scheduler_stats is not None:
                outputs.scheduler_stats.expert_tokens = self._expert_tokens
            following = in_flight[0] if in_flight else None
            if following is not None and following.deferred_mask is not None and not following.deferred_mask.is_set:
                # The next step's constrained requests have their previous token now: its masks, at once
                # (its worker is waiting for them, or soon will be), before the outputs go out.
                self._phase = "step loop: computing a deferred step's grammar masks"
                bitmask = self.scheduler.get_grammar_bitmask(following.scheduler_output)
                await self.executor.deliver_masks(following.deferred_mask, bitmask)
            update_end = time.monotonic()
            if self._trace is not None and not step.scheduler_output.is_empty:  # (not a step that only forgets)
                timings = runner_output.timings or StepTimings(-1.0, -1.0, -1.0)
                self._trace.append(
                    StepRecord(
                        step.step, step.scheduler_output.total_num_scheduled_tokens, step.schedule_start,
                        step.schedule_end, runner_output.started_at, runner_output.finished_at, update_start, update_end,
                        timings.prepare, timings.forward, timings.sample, timings.device_forward, timings.cuda_graph,
                    )
                )
            outputs.step_seconds = time.monotonic() - step.schedule_start
            await self.send(outputs)
