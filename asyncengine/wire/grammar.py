"""What the engine core and its grammar-compile process exchange (structured_output/compile_process.py).

The engine core sends the tokenizer once (CompilerSetup), then one CompileGrammar at a time: a backend by
its import path and the constraint. The process compiles it and answers GrammarCompiled with the time it took
and the memory the compiled grammar holds, or the backend's refusal; the compiled grammar itself stays there
(xgrammar's serialized form is 3 to 40 times its memory and slower to make than the grammar: the engine core
compiles it again, now known to finish; docs/structured_outputs.md, "Bounds").
"""

from __future__ import annotations

from typing import Union

import msgspec

from asyncengine.structured_output_spec import GrammarSpec
from asyncengine.wire.messages import Hello


class CompilerSetup(msgspec.Struct, tag=True, kw_only=True):
    tokenizer_dir: str
    vocab_size: int
    eos_token_ids: list[int]
    trust_remote_code: bool = False


class CompileGrammar(msgspec.Struct, tag=True, kw_only=True):
    job: int
    backend: str  # "pkg.mod:Class", a StructuredOutputBackend subclass
    spec: GrammarSpec


class CompileStarted(msgspec.Struct, tag=True, kw_only=True):
    """The backend is built (the first time: the tokenizer's tables too): the compile's time limit starts now."""

    job: int


class GrammarCompiled(msgspec.Struct, tag=True, kw_only=True):
    job: int
    seconds: float = 0.0
    size_bytes: int = 0  # what the compiled grammar held (the larger of the backend's figure and the RSS it kept)
    error: str | None = None  # the backend's refusal (a ValueError's message); None when it compiled
    failure: str | None = None  # the process could not build the backend (not the grammar's fault)
    process_rss_bytes: int = 0  # the process's resident memory after the compile, its grammar dropped


CompilerInbox = Union[CompilerSetup, CompileGrammar]
CompilerParentInbox = Union[Hello, CompileStarted, GrammarCompiled]
