"""What the engine returns to callers: RequestOutput and CompletionOutput (vLLM's shapes)."""

from __future__ import annotations

import msgspec


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One of the `n` completions of a request.

    In a stream, `text`, `token_ids` and `logprobs` hold only what is new since the previous output;
    from `LLM.generate` they hold everything.
    """

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    # Per token: {token id: logprob} for the chosen token and the top-N.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the completion, when one did.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
