"""PoolingParams: how to pool one request, with vLLM's names (`dimensions`, `normalize`,
`truncate_prompt_tokens`, `task`, `use_activation`).

Every check raises `RequestError` naming the field. Checks that need the model (is it Matryoshka? how
long may a prompt be?) are the frontend's (asyncengine/frontend/pooling.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncengine.errors import RequestError

# What a pooling request may ask for (vLLM's pooling tasks). The per-token ones give one output per prompt token
# (ColBERT-style multi-vector embeddings, BGE-M3-style token weights); "plugin" (vLLM's task of an IO
# processor's requests) is the model's own task: embed, or classify for a classifier.
TASKS = ("embed", "classify", "score", "encode", "token_embed", "token_classify", "plugin")
TOKEN_TASKS = ("token_embed", "token_classify")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first N values of the embedding (Matryoshka models only); `normalize`: L2-normalize
    the embedding (None: the model's choice, from sentence-transformers' Normalize module or the pooler config);
    `truncate_prompt_tokens`: keep only the last N prompt tokens (-1: up to max_model_len), instead of refusing
    a prompt that is too long; `use_activation`: softmax (or sigmoid for one label) over class scores."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    use_activation: bool | None = None
    # vLLM's: values an IO processor attaches for its own use; kept on the params, not sent to the worker's pooler.
    extra_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise RequestError(f"dimensions must be a positive integer, got {self.dimensions!r}", field="dimensions")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise RequestError(f"truncate_prompt_tokens must be a positive integer or -1 (up to max_model_len), got "
                               f"{self.truncate_prompt_tokens!r}", field="truncate_prompt_tokens")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise RequestError(f"{name} must be true or false, got {value!r}", field=name)
        if self.task is not None and self.task not in TASKS:
            raise RequestError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}", field="task")
