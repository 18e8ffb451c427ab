"""Compiling grammars in the engine core: the compiled-grammar cache, the compiles in progress, and where each runs.

- **Cache**: compiled grammars by (backend, grammar) hash, within `structured_outputs_cache_bytes`; the least
  recently used are evicted past it (and freed in a thread, then the heap trimmed: cache.py). Each is charged
  what its backend says it holds (`compiled_size`), or what the grammar-compile process measured when larger.
  A grammar larger than the whole budget serves its requests but is not kept. Refused grammars are remembered
  too (the last MAX_FAILURES), so a repeated bad one costs nothing.
- **One compile per grammar**: requests asking for a grammar being compiled wait for that compile. When every
  one of them has left (aborted), the compile is cancelled and its result never cached.
- **Where**: a source larger than INLINE_COMPILE_BYTES, for a backend with `isolated_compile` (xgrammar), is
  compiled first in the grammar-compile process (compiler_process.py), under the time limit
  (`structured_outputs_compile_timeout`); past it, or when cancelled, the process is killed. What compiled there
  is compiled again here, in a thread: the same work, now known to end (xgrammar's serialized form costs more
  than compiling again: docs/structured_outputs.md, "Bounds"). Smaller sources compile here directly, in a
  thread, one at a time: measured, the slowest of them take well under a second (the frontend's limits bound
  them: limits.py), and at the time limit the request is refused while the thread ends on its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from asyncengine.runtime.memory import trim_heap
from asyncengine.structured_output.backend import GrammarError
from asyncengine.interfaces.structured_output import StructuredOutputBackend
from asyncengine.structured_output.cache import LRUCache
from asyncengine.structured_output.compiler_process import CompilerFailed, CompilerProcess
from asyncengine.structured_output_spec import GrammarSpec

# Sources up to this many bytes compile in the engine core directly (module docstring). Measured on 2 cores
# (docs/structured_outputs.md): a 16 KiB JSON schema of 500 properties 0.1-0.5 s, 2,000 regex words 0.06 s, a
# 14 KiB ambiguous grammar 0.6 s.
INLINE_COMPILE_BYTES = 16 * 1024
MAX_FAILURES = 1024


class CompilerUnavailable(GrammarError):
    """The grammar-compile process died or could not build the backend: the request fails, but the grammar is
    not remembered as refused (the next request with it tries again)."""


@dataclass(eq=False)
class _Job:
    """One grammar's compile, shared by the requests waiting for it."""

    key: str
    backend: StructuredOutputBackend
    spec: GrammarSpec
    waiters: set[str] = field(default_factory=set)
    done: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    compiled: Any = None
    error: GrammarError | None = None


class Compilations:
    def __init__(self, *, cache_bytes: int, timeout: float, tokenizer_dir: str | None, vocab_size: int,
                 eos_token_ids: list[int], stats: Any, trust_remote_code: bool = False) -> None:
        self.cache = LRUCache(cache_bytes)
        self.failures = LRUCache(MAX_FAILURES)  # GrammarErrors, one entry each
        self.timeout = timeout
        self.process = CompilerProcess(tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                                       eos_token_ids=eos_token_ids, trust_remote_code=trust_remote_code)
        self.stats = stats
        self._jobs: dict[str, _Job] = {}
        self._waiting: dict[str, _Job] = {}  # request id -> the compile it waits for
        self._one_at_a_time = anyio.Lock()  # compiles in the engine core's threads
        self._tg: anyio.abc.TaskGroup | None = None
        self._to_free: list[Any] = []
        self._trim = False
        self._free_wanted = anyio.Event()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the compiles and the grammar-compile process until cancelled (the engine core's step loop ends)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._free_in_thread)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            await self.process.stop(killed=False)

    async def compiled(self, request_id: str, backend: StructuredOutputBackend, key: str, spec: GrammarSpec) -> Any:
        """`spec` compiled (GrammarError when refused), from the cache or once compiled; None when the compile
        was cancelled because every request waiting for it, this one included, left (`forget`)."""
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.num_cache_hits += 1
            return cached
        refused = self.failures.get(key)
        if refused is not None:
            raise refused
        job = self._jobs.get(key)
        if job is None:
            if self._tg is None:
                raise RuntimeError("grammars are compiled only while Compilations.serve runs (the engine core's step loop)")
            job = self._jobs[key] = _Job(key, backend, spec)
            self._tg.start_soon(self._run, job)
        else:
            self.stats.num_cache_hits += 1  # shares a compile in progress
        job.waiters.add(request_id)
        self._waiting[request_id] = job
        try:
            await job.done.wait()
        finally:
            if self._waiting.get(request_id) is job:
                del self._waiting[request_id]
            job.waiters.discard(request_id)
        if job.error is not None:
            raise job.error
        return job.compiled

    def forget(self, request_id: str) -> None:
        """The request left (aborted, finished): a compile that no other request waits for is cancelled."""
        job = self._waiting.pop(request_id, None)
        if job is None:
            return
        job.waiters.discard(request_id)
        if not job.waiters and not job.done.is_set():
            job.scope.cancel()
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            self.stats.num_compiles_cancelled += 1
            job.done.set()  # its waiting request goes at once; the compile's task cleans up (kills the process)

    def free(self, values: list[Any], *, trim: bool = False) -> None:
        """Drop the last references to `values` in a thread (a large grammar's destructor takes milliseconds)."""
        if values:
            self._to_free.extend(values)
            self._trim = self._trim or trim
            self._free_wanted.set()

    # -- the compile of one grammar (a task of `serve`'s group) --------------------------------------------

    async def _run(self, job: _Job) -> None:
        with job.scope:
            try:
                compiled, size = await self._compile(job.backend, job.spec)
            except GrammarError as refused:
                job.error = refused
                if not isinstance(refused, CompilerUnavailable):
                    self.failures.put(job.key, refused, 1)
            else:
                if job.scope.cancel_called:  # it finished just as its last request left: not kept either
                    self.free([compiled], trim=True)
                else:
                    job.compiled = compiled
                    kept, evicted = self.cache.put(job.key, compiled, size)
                    if not kept:
                        self.stats.num_uncached += 1
                    self.free(evicted, trim=True)
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        job.done.set()

    async def _compile(self, backend: StructuredOutputBackend, spec: GrammarSpec) -> tuple[Any, int]:
        name = backend.name or type(backend).__name__
        started = time.perf_counter()
        if type(backend).isolated_compile and len(spec.text.encode()) > INLINE_COMPILE_BYTES:
            path = f"{type(backend).__module__}:{type(backend).__qualname__}"
            try:
                verdict = await self.process.compile(path, spec, timeout=self.timeout)
            except TimeoutError:
                self.stats.num_timeouts += 1
                raise GrammarError(name, spec, self._too_slow("the compile was stopped")) from None
            except CompilerFailed as failed:
                raise CompilerUnavailable(name, spec, f"it could not be compiled: {failed}") from failed
            finally:
                self.stats.compile_process_seconds += time.perf_counter() - started
            if verdict.error is not None:
                raise GrammarError(name, spec, verdict.error.strip())
            self.stats.num_isolated_compiles += 1
            compiled, size = await self._in_thread(backend, spec, name)  # known to end: no limit
            size = max(size, verdict.size_bytes)
        else:
            try:
                with anyio.fail_after(self.timeout):
                    compiled, size = await self._in_thread(backend, spec, name)
            except TimeoutError:
                self.stats.num_timeouts += 1
                raise GrammarError(name, spec, self._too_slow("the request was refused")) from None
        self.stats.compile_seconds += time.perf_counter() - started
        self.stats.num_compiled += 1
        return compiled, size

    async def _in_thread(self, backend: StructuredOutputBackend, spec: GrammarSpec, name: str) -> tuple[Any, int]:
        abandoned = threading.Event()

        def compile_and_measure() -> tuple[Any, int]:
            try:
                compiled = backend.compile(spec)
            except ValueError as exc:
                if isinstance(exc, GrammarError):
                    raise
                raise GrammarError(name, spec, str(exc).strip()) from exc
            if abandoned.is_set():  # nobody waits for it any more: freed here, not on the event loop
                del compiled
                return None, 0
            return compiled, backend.compiled_size(compiled)

        async with self._one_at_a_time:
            try:
                return await anyio.to_thread.run_sync(compile_and_measure, abandon_on_cancel=True)
            except BaseException:
                abandoned.set()
                raise

    def _too_slow(self, outcome: str) -> str:
        return (f"compiling it took longer than {self.timeout:g} s, the limit (structured_outputs_compile_timeout, "
                f"the server's --structured-outputs-compile-timeout): {outcome}; simplify the constraint, or raise "
                "the limit")

    async def _free_in_thread(self) -> None:
        while True:
            await self._free_wanted.wait()
            self._free_wanted = anyio.Event()
            values, self._to_free = self._to_free, []
            trim, self._trim = self._trim, False
            await anyio.to_thread.run_sync(_drop, values, trim)


def _drop(values: list[Any], trim: bool) -> None:
    values.clear()
    if trim:
        trim_heap()
