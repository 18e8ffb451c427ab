"""The tokenizer modes' table (docs/reference.md, tokenizers): `tokenizer_mode` -> a class built as
`Class.from_pretrained(path)`, as in vLLM.

A plugin adds a mode with `TokenizerRegistry.register("mode", "pkg.mod:Class")`. The built-in "auto"
mode (transformers' AutoTokenizer) is registered here by path: its code, the lookup and the loading are
the frontend's (asyncengine/frontend/tokenizer.py), the one process that tokenizes.
"""

from __future__ import annotations

from asyncengine.interfaces.registry import BUILT_IN, Registry

AUTO = "auto"


class _TokenizerRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("tokenizers", "tokenizer mode")
        self.register(AUTO, "asyncengine.frontend.tokenizer:HFAutoTokenizer", owner=BUILT_IN)


TokenizerRegistry = _TokenizerRegistry()

__all__ = ["AUTO", "TokenizerRegistry"]
