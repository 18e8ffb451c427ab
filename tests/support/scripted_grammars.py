"""A structured-output backend whose grammars are scripts, for the engine core's compile machinery
(tests/structured_output/test_compiling.py). Importable by path, so that the grammar-compile process can build it
(with tests/ on its PYTHONPATH).

A grammar's text: `busy=SECONDS tokens=A,B,C pad=...`. Compiling spins the CPU for SECONDS (as a real compile
holds a core), then gives a grammar that allows exactly the tokens A, B, C in that order, then the EOS, so
`tokens=` (none) allows the EOS alone and `tokens=5 end=no` is a dead end after token 5. `pad` makes a source
large enough for the grammar-compile process.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from asyncengine.plugins_api import GrammarMatcher, StructuredOutputBackend


def script(*, busy: float = 0.0, tokens: tuple[int, ...] = (), end: bool = True, pad: int = 0) -> str:
    return f"busy={busy} tokens={','.join(map(str, tokens))} end={'yes' if end else 'no'} pad={'x' * pad}"


class _Script:
    def __init__(self, text: str) -> None:
        fields = dict(part.split("=", 1) for part in text.split(" "))
        self.busy = float(fields["busy"])
        self.tokens = [int(token) for token in fields["tokens"].split(",") if token]
        self.end = fields["end"] == "yes"
        self.ballast = bytearray(1 << 20)  # something to charge the cache with: about 1 MiB


class _Matcher(GrammarMatcher):
    def __init__(self, compiled: _Script, eos: int) -> None:
        self.compiled = compiled
        self.eos = eos
        self.position = 0
        self.done = False

    def _allowed(self) -> list[int]:
        if self.position < len(self.compiled.tokens):
            return [self.compiled.tokens[self.position]]
        return [self.eos] if self.compiled.end and not self.done else []

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._allowed():
            return False
        if token_id == self.eos and self.position == len(self.compiled.tokens):
            self.done = True
        else:
            self.position += 1
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = np.zeros(bitmask.shape[1], dtype=np.uint32)
        for token_id in self._allowed():
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))
        bitmask[row] = words.view(np.int32)

    def is_terminated(self) -> bool:
        return self.done


class ScriptedBackend(StructuredOutputBackend):
    name = "scripted"
    isolated_compile = True

    def compile(self, spec: Any) -> _Script:
        if spec.kind != "grammar":
            raise ValueError("the scripted backend takes grammars only")
        compiled = _Script(spec.text)
        deadline = time.perf_counter() + compiled.busy
        while time.perf_counter() < deadline:  # a compile holds a core
            pass
        return compiled

    def matcher(self, compiled: _Script) -> GrammarMatcher:
        return _Matcher(compiled, self.eos_token_ids[0])
