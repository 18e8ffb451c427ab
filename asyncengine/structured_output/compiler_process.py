"""The engine core's side of its grammar-compile process (compiler_main.py): where a compile can be stopped.

The process starts at the first compile that needs it (a fresh interpreter, as every child: spawn.py), so an
engine that never compiles a large grammar never pays for it (about 3 s of imports and tokenizer tables, and
the 0.4-0.5 GB it then holds). It compiles one grammar at a time; `compile` waits its turn. The time limit
starts when the process says CompileStarted (its start-up and the backend's tables are not the grammar's
doing). At the limit, or when the caller is cancelled (no request waits for the compile any more), the process
is killed, and the next compile starts a new one.
"""

from __future__ import annotations

import itertools
import logging

import anyio
from anyio.abc import Process

from asyncengine.runtime.connection import accept_child, open_listener
from asyncengine.runtime.spawn import describe_exit, spawn_child
from asyncengine.structured_output_spec import GrammarSpec
from asyncengine.wire.framing import FrameStream, ProtocolError
from asyncengine.wire.grammar import CompileGrammar, CompilerParentInbox, CompilerSetup, CompileStarted, GrammarCompiled

logger = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds for the process to start, connect, and build a backend (imports, token tables)
# A process that holds more than this after a compile (its allocator keeps what big compiles left) is replaced.
MAX_IDLE_RSS_BYTES = 2 * 1024**3


class CompilerFailed(Exception):
    """The grammar-compile process died, or could not build the backend: the compile did not happen."""


class CompilerProcess:
    def __init__(self, *, tokenizer_dir: str | None, vocab_size: int, eos_token_ids: list[int],
                 trust_remote_code: bool = False) -> None:
        self.setup = CompilerSetup(tokenizer_dir=tokenizer_dir or "", vocab_size=vocab_size,
                                   eos_token_ids=list(eos_token_ids), trust_remote_code=trust_remote_code)
        self._turn = anyio.Lock()
        self._process: Process | None = None
        self._frames: FrameStream | None = None
        self._jobs = itertools.count()
        self.compiling = False  # a compile is under way in the process (after CompileStarted)
        self.num_started = 0
        self.num_killed = 0  # at the time limit, or when no request waited any more

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def compile(self, backend_path: str, spec: GrammarSpec, *, timeout: float) -> GrammarCompiled:
        """Compile `spec` with the backend class at `backend_path` in the process. TimeoutError past `timeout`
        seconds of compiling; CompilerFailed when the process died or could not build the backend."""
        async with self._turn:
            frames = await self._started()
            job = next(self._jobs)
            try:
                with anyio.fail_after(START_TIMEOUT):
                    await frames.send(CompileGrammar(job=job, backend=backend_path, spec=spec))
                    reply = await self._reply(frames, job)
                if isinstance(reply, CompileStarted):
                    self.compiling = True
                    with anyio.fail_after(timeout):
                        reply = await self._reply(frames, job)
            except BaseException:  # the limit, a cancelled request, a dead process: nothing may keep compiling
                await self.stop(killed=True)
                raise
            finally:
                self.compiling = False
            if not isinstance(reply, GrammarCompiled):
                await self.stop(killed=True)
                raise CompilerFailed(f"the grammar-compile process sent {type(reply).__name__} twice")
            if reply.failure is not None:
                raise CompilerFailed(f"the grammar-compile process could not build the backend: {reply.failure}")
            if reply.process_rss_bytes > MAX_IDLE_RSS_BYTES:
                logger.info("the grammar-compile process holds %d MB after a compile: replacing it",
                            reply.process_rss_bytes // 2**20)
                await self.stop(killed=False)
            return reply

    async def _reply(self, frames: FrameStream, job: int) -> CompileStarted | GrammarCompiled:
        try:
            reply = await frames.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ProtocolError) as exc:
            process = self._process
            if process is not None:
                with anyio.move_on_after(2.0):
                    await process.wait()
            status = describe_exit(process.returncode if process is not None else None)
            raise CompilerFailed(f"the grammar-compile process {status} while compiling (see its log)") from exc
        if not isinstance(reply, (CompileStarted, GrammarCompiled)) or reply.job != job:
            raise CompilerFailed(f"the grammar-compile process answered {reply!r} to compile {job}")
        return reply

    async def _started(self) -> FrameStream:
        if self._frames is not None and self._process is not None and self._process.returncode is None:
            return self._frames
        await self.stop(killed=False)
        listener = await open_listener()
        try:
            self._process = await spawn_child("asyncengine.structured_output.compiler_main", address=listener.address,
                                              secret=listener.secret)
            try:
                frames, _ = await accept_child(listener, CompilerParentInbox, role="grammar compiler",
                                               timeout=START_TIMEOUT)
            except TimeoutError as exc:
                status = describe_exit(self._process.returncode)
                await self.stop(killed=False)
                raise CompilerFailed(f"the grammar-compile process did not connect within {START_TIMEOUT:.0f} s "
                                     f"(it {status})") from exc
            except BaseException:
                await self.stop(killed=False)
                raise
        finally:
            await listener.aclose()
        await frames.send(self.setup)
        self._frames = frames
        self.num_started += 1
        return frames

    async def stop(self, *, killed: bool) -> None:
        """Kill the process now (it holds no state worth a grace period) and forget it."""
        process, frames = self._process, self._frames
        self._process = self._frames = None
        with anyio.CancelScope(shield=True):
            if frames is not None:
                await frames.aclose()
            if process is not None:
                if process.returncode is None:
                    process.kill()
                    if killed:
                        self.num_killed += 1
                await process.wait()
