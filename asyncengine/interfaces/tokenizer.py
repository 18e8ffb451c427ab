"""The tokenizer modes' table (docs/reference.md, tokenizers): `tokenizer_mode` -> a class built as
`Class.from_pretrained(path)`, as in vLLM.

A plugin adds a mode with `TokenizerRegistry.register("mode", "pkg.mod:Class")`. The built-in "auto"
mode (transformers' AutoTokenizer) is registered here by path: its code, the lookup and the loading are
the frontend's (asyncengine/frontend/tokenizer.py), the one process that tokenizes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from asyncengine.errors import ConfigError
from asyncengine.interfaces.registry import BUILT_IN, Registry

AUTO = "auto"


@runtime_checkable
class TokenizerClass(Protocol):
    """What a tokenizer mode names: a class built as `Class.from_pretrained(path)`, as transformers' are."""

    def from_pretrained(self, path: Any, *args: Any, **kwargs: Any) -> Any: ...


TokenizerRegistry: Registry[Any] = Registry(
    "tokenizers", "tokenizer mode", TokenizerClass, field="tokenizer_mode",
    expected="a class with from_pretrained(path), as transformers' tokenizers have",
    unknown='tokenizer_mode {key!r} names no tokenizer; known: {known} (a plugin adds one with '
            'TokenizerRegistry.register("mode", "pkg.mod:Class"))',
    import_error=lambda message, field: ConfigError(message, field=field))
TokenizerRegistry.register(AUTO, "asyncengine.frontend.tokenizer:HFAutoTokenizer", owner=BUILT_IN)

__all__ = ["AUTO", "TokenizerClass", "TokenizerRegistry"]
