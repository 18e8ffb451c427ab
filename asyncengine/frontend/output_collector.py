"""OutputCollector: the one-slot mailbox between the output handler and one request's consumer.

The handler never waits for a consumer: if the consumer has not taken the previous output yet, the
new one is merged into it (text and tokens appended), so a slow reader costs memory for its own
request only and delays nobody else. Only a generation's outputs come more than once (RequestOutput
deltas, merged here); a request of another kind (pooling) gets its one output, or its error.
"""

from __future__ import annotations

from typing import Any

import anyio

from asyncengine.outputs import CompletionOutput, RequestOutput


class OutputCollector:
    def __init__(self) -> None:
        self._output: Any = None
        self._error: BaseException | None = None
        self._ready = anyio.Event()

    def put(self, output: Any) -> None:
        self._output = output if self._output is None else merge_outputs(self._output, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> Any:
        """The next output (or the merge of all since the last get); raises the failure after it."""
        while True:
            if self._output is not None:
                output, self._output = self._output, None
                return output
            if self._error is not None:
                raise self._error
            self._ready = anyio.Event()
            await self._ready.wait()


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta holding what `earlier` and then `later` added."""
    merged: dict[int, CompletionOutput] = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        previous = merged.get(completion.index)
        if previous is None:
            merged[completion.index] = completion
            continue
        logprobs = None
        if previous.logprobs is not None or completion.logprobs is not None:
            logprobs = (previous.logprobs or []) + (completion.logprobs or [])
        merged[completion.index] = CompletionOutput(
            index=completion.index,
            text=previous.text + completion.text,
            token_ids=previous.token_ids + completion.token_ids,
            logprobs=logprobs,
            cumulative_logprob=completion.cumulative_logprob,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
    return RequestOutput(
        request_id=later.request_id,
        prompt=later.prompt,
        prompt_token_ids=later.prompt_token_ids,
        outputs=[merged[index] for index in sorted(merged)],
        finished=later.finished,
        num_cached_tokens=later.num_cached_tokens,
    )
