"""The grammar-compile process (`python -m asyncengine.structured_output.compiler_main`), a child of the engine core.

It connects back with the per-launch secret, receives CompilerSetup (the tokenizer's directory), then
compiles one grammar at a time: for each CompileGrammar it builds the backend the first time (its class by
import path, from the tokenizer), says CompileStarted, compiles, and answers GrammarCompiled with the time and
the memory the compiled grammar held, or the backend's refusal. The compiled grammar is dropped: the engine core
compiles again what compiled here (wire/grammar.py says why). The engine core kills this process when a
compile runs past its time limit or no request waits for it any more; it exits with its parent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.runtime.connection import connect_to_parent
from asyncengine.runtime.memory import rss_bytes, trim_heap
from asyncengine.runtime.signals import ignore_interrupts
from asyncengine.runtime.spawn import ENV_ADDRESS, ENV_SECRET, die_with_parent
from asyncengine.interfaces.structured_output import StructuredOutputBackend
from asyncengine.structured_output.backend import load_tokenizer
from asyncengine.wire.grammar import CompileGrammar, CompilerInbox, CompilerSetup, CompileStarted, GrammarCompiled

ROLE = "grammar compiler"


class _Compiler:
    def __init__(self, setup: CompilerSetup) -> None:
        self.setup = setup
        self.tokenizer: Any = None
        self.backends: dict[str, StructuredOutputBackend] = {}

    def backend(self, path: str) -> StructuredOutputBackend:
        backend = self.backends.get(path)
        if backend is None:
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.setup.tokenizer_dir, trust_remote_code=self.setup.trust_remote_code)
            cls = import_by_path(path, what="structured-output backend", error=ModelLoadError)
            backend = self.backends[path] = cls(self.tokenizer, self.setup.vocab_size, self.setup.eos_token_ids)
        return backend

    @staticmethod
    def compile(job: int, backend: StructuredOutputBackend, spec: Any) -> GrammarCompiled:
        trim_heap()
        before = rss_bytes()
        started = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except ValueError as refused:  # the backend's refusal, as the engine core's compile would meet it
            return GrammarCompiled(job=job, seconds=time.perf_counter() - started, error=str(refused))
        seconds = time.perf_counter() - started
        trim_heap()  # what the compile freed again, so that the difference is what the grammar keeps
        kept = rss_bytes() - before
        size = max(backend.compiled_size(compiled), kept)
        del compiled
        trim_heap()
        return GrammarCompiled(job=job, seconds=seconds, size_bytes=size, process_rss_bytes=rss_bytes())


async def serve() -> None:
    frames = await connect_to_parent(os.environ[ENV_ADDRESS], os.environ[ENV_SECRET], CompilerInbox, role=ROLE,
                                     rank=0)
    try:
        setup = await frames.receive()
        if not isinstance(setup, CompilerSetup):
            raise RuntimeError(f"the grammar-compile process expected CompilerSetup first, got {type(setup).__name__}")
        compiler = _Compiler(setup)
        while True:
            message = await frames.receive()
            if not isinstance(message, CompileGrammar):
                raise RuntimeError(f"the grammar-compile process expected CompileGrammar, got {type(message).__name__}")
            try:
                backend = await anyio.to_thread.run_sync(compiler.backend, message.backend)
            except Exception as exc:  # the backend (or the tokenizer) cannot be built here: the engine core says so
                await frames.send(GrammarCompiled(job=message.job, failure=f"{type(exc).__name__}: {exc}"))
                continue
            await frames.send(CompileStarted(job=message.job))
            await frames.send(await anyio.to_thread.run_sync(compiler.compile, message.job, backend, message.spec))
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return  # the engine core is gone, or done with this process


def main() -> int:
    die_with_parent()
    ignore_interrupts()
    logging.basicConfig(level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s {ROLE} %(name)s: %(message)s")
    anyio.run(serve, backend=os.environ.get("ASYNCENGINE_CHILD_BACKEND", "trio"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
