"""A worker process (`python -m asyncengine.worker.process`): one tensor-parallel rank.

Start-up: hand-shake, then `init device` (joins the process group when there are several ranks).
Then it serves the engine core's messages in order: steps and method calls, each run in a thread so
the event loop keeps reading its connection. Sent CheckParams (`plugins check`) instead of
StartupParams, it runs only its plugin phases, says Ready and exits.
"""

from __future__ import annotations

import os
import traceback
from collections import deque
from functools import partial
from typing import Any

import anyio

from asyncengine.errors import (
    AsyncEngineError,
    WorkerError,
    error_field,
    error_type_name,
    qualified_type_name,
    raising_code,
)
from asyncengine.interfaces.roles import WORKER
from asyncengine.plugin_runtime.phases import run_plugin_phases
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.runtime.child import child_main
from asyncengine.runtime.dedicated_thread import DedicatedThread
from asyncengine.runtime.reply import Reply
from asyncengine.structured_output.deferred import DeferredMask, takes_grammar
from asyncengine.wire.framing import FrameStream, ProtocolError
from asyncengine.wire.messages import (
    CheckParams,
    ExecuteModel,
    GrammarMasks,
    Ready,
    Shutdown,
    StartupParams,
    StepResult,
    WorkerCall,
    WorkerCallResult,
    WorkerInbox,
)
from asyncengine.worker.extension import rpc_method


async def serve_worker(frames: FrameStream, params: StartupParams, trace: StartupTrace) -> None:
    from asyncengine.worker.build import build_worker

    state = await run_plugin_phases({WORKER}, params.engine_config, trace, device=params.platform,
                                    device_chosen_by="the frontend", frontend_manifest=params.manifest)
    worker = build_worker(  # the class `worker_cls` names, the built-in Worker by default
        params.engine_config, params.model_config, state.platform, rank=params.rank,
        world_size=params.world_size, distributed_init_method=params.distributed_init_method,
        logits_processors=state.logits_processors,
    )
    # Every call runs on one thread for the process's life (see runtime/dedicated_thread.py).
    thread = DedicatedThread("asyncengine-worker")
    async with anyio.create_task_group() as tg:
        await tg.start(thread.serve)
        try:
            async with trace.phase("init device"):  # a plugin's worker class raising is named (extension.py)
                await thread.run(rpc_method(worker, "init_device"))
            async with trace.phase("ready"):
                pass
            # Whether this rank can run a step whose grammar masks follow it (structured_output/deferred.py).
            info = {"rank": params.rank, "deferred_grammar": takes_grammar(worker.execute_model)}
            await frames.send(Ready(info=info, records=trace.records))
            trace.ready = True
            await _serve_messages(frames, worker, thread)
        finally:
            thread.close()


async def check_worker(frames: FrameStream, params: CheckParams, trace: StartupTrace) -> None:
    """`plugins check`: this rank's plugin phases (manifest check included), Ready, and exit; no worker is
    built, no device touched."""
    await run_plugin_phases({WORKER}, params.engine_config, trace, device=params.platform,
                            device_chosen_by="the frontend", frontend_manifest=params.manifest)
    async with trace.phase("ready"):
        pass
    await frames.send(Ready(info={"rank": params.rank}, records=trace.records))
    trace.ready = True


# Answers owed to the engine core, in order. It keeps at most two steps in flight (async scheduling)
# plus its method calls, so 64 is never reached in normal use; when it is, the reading task waits
# (and so the engine core's sends back up in the socket) while the answering task, which waits only
# on the thread and the engine core's reading of its connection, never on the reader, frees a slot.
ANSWERS_BOUND = 64


async def _serve_messages(frames: FrameStream, worker, thread: DedicatedThread) -> None:
    """Hand each message to the thread as soon as it arrives (so step N+1 starts the moment step N
    ends), and send the answers back in order from a second task. A step whose grammar masks follow it
    waits on a DeferredMask that the next GrammarMasks frame sets (one per such step, in order)."""
    answers, pending = anyio.create_memory_object_stream[tuple[Any, Reply]](ANSWERS_BOUND)
    masks: deque[DeferredMask] = deque()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_answers, frames, pending)
            async with answers:
                await _read_messages(frames, worker, thread, answers, masks)
    finally:
        for mask in masks:  # the engine core is gone or stopping: a step waiting on masks fails, not hangs
            mask.cancel()


async def _read_messages(frames: FrameStream, worker, thread: DedicatedThread, answers, masks) -> None:
    while True:
        message = await frames.receive()
        if isinstance(message, ExecuteModel):
            scheduler_output = message.scheduler_output
            if scheduler_output.deferred_grammar_request_ids is None:
                reply = thread.submit(worker.execute_model, scheduler_output)
            else:
                mask = DeferredMask()
                masks.append(mask)
                reply = thread.submit(worker.execute_model, scheduler_output, mask)
            await answers.send((message, reply))
        elif isinstance(message, GrammarMasks):
            if not masks:
                raise ProtocolError("the engine core sent grammar masks, but no step of this rank waits for any")
            masks.popleft().set(message.bitmask)
        elif isinstance(message, WorkerCall):
            try:  # the worker's method, else its extension's (worker/extension.py)
                method = rpc_method(worker, message.method)
            except WorkerError as exc:
                reply = Reply()
                reply.fail(exc)
            else:
                if message.kwargs:  # the keyword arguments travel with the call
                    method = partial(method, **message.kwargs)
                reply = thread.submit(method, *message.args)
            await answers.send((message, reply))
        elif isinstance(message, Shutdown):
            while masks:  # a step still waiting on masks fails now, so that shutdown can run after it
                masks.popleft().cancel()
            await answers.send((message, thread.submit(worker.shutdown)))
            break


async def _send_answers(frames: FrameStream, pending) -> None:
    async with pending:
        async for message, reply in pending:
            if isinstance(message, ExecuteModel):
                try:
                    output = await reply.wait()
                except Exception as exc:  # the engine core names this rank and fails every request
                    culprit = raising_code(exc)
                    where = f"worker process pid {os.getpid()}, execute_model"
                    await frames.send(StepResult(error=_summary(exc), error_type=qualified_type_name(exc),
                                                 error_message=str(exc),
                                                 culprit=f"{culprit} in {where}" if culprit else where))
                    raise
                await frames.send(StepResult(output=output))
            elif isinstance(message, WorkerCall):
                try:
                    result = await reply.wait()
                except Exception as exc:  # the caller gets the error with this rank's name
                    await frames.send(
                        WorkerCallResult(call_id=message.call_id, error_type=error_type_name(exc),
                                         # our own errors keep their type by name: the message alone suffices
                                         error=str(exc) if isinstance(exc, AsyncEngineError) else _summary(exc),
                                         error_field=error_field(exc))
                    )
                else:
                    await frames.send(WorkerCallResult(call_id=message.call_id, result=result))
            else:
                await reply.wait()  # Shutdown: the process group is torn down, then we exit


def _summary(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


if __name__ == "__main__":
    raise SystemExit(child_main("worker", WorkerInbox, serve_worker, StartupTrace, check=check_worker))
