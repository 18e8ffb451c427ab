"""OutputProcessor: from the engine core's per-step token outputs to RequestOutputs.

It detokenizes incrementally, finds stop strings (then asks for the engine-core request to be
aborted, since the core only knows token-level stops), gathers the `n` completions of a request, and
emits either deltas (streaming) or one final output. A completion that failed in the engine (finish
reason "error": a worker refused it) fails its whole request with a RequestError, and its other
completions are aborted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from asyncengine.errors import RequestError
from asyncengine.frontend.detokenizer import IncrementalDetokenizer
from asyncengine.frontend.processor import ProcessedRequest
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.wire.engine_core import EngineCoreOutput, FinishReason


class OutputKind(enum.Enum):
    DELTA = "delta"  # each output carries what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, when every completion has finished


@dataclass
class _Completion:
    index: int
    core_request_id: str
    detokenizer: IncrementalDetokenizer | None
    min_tokens: int
    include_stop_str_in_output: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Where the last delta ended, in token_ids (and logprobs) and in text; whether the end was sent.
    sent_tokens: int = 0
    sent_text: int = 0
    sent_final: bool = False

    def has_news(self) -> bool:
        return (
            self.sent_tokens < len(self.token_ids)
            or self.sent_text < len(self.text)
            or (self.finished and not self.sent_final)
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _RequestState:
    request: ProcessedRequest
    kind: OutputKind
    completions: list[_Completion]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Engine-core requests to abort because a stop string ended them in the frontend (or a sibling
    # completion failed).
    core_requests_to_abort: list[str]
    # Requests that failed in the engine, with the error their consumer gets; they are forgotten here.
    failed_requests: list[tuple[str, RequestError]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._by_core_id: dict[str, tuple[_RequestState, _Completion]] = {}

    def add_request(self, request: ProcessedRequest, kind: OutputKind) -> None:
        params = request.params
        completions = []
        for index, child in enumerate(request.children):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            completion = _Completion(
                index=index,
                core_request_id=child.request_id,
                detokenizer=detokenizer,
                min_tokens=params.min_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            completions.append(completion)
        state = _RequestState(request, kind, completions)
        self._requests[request.request_id] = state
        for completion in completions:
            self._by_core_id[completion.core_request_id] = (state, completion)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def abort_request(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Forget a request. Returns the engine-core ids of its unfinished completions (to abort there)
        and its last output, where those completions end with finish_reason "abort"."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return [], None
        unfinished = [c for c in state.completions if not c.finished]
        for completion in state.completions:
            self._by_core_id.pop(completion.core_request_id, None)
        for completion in unfinished:
            if completion.detokenizer is not None:
                completion.text += completion.detokenizer.flush()
            completion.finish_reason = FinishReason.ABORT
        return [c.core_request_id for c in unfinished], self._make_output(state)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        to_abort: list[str] = []
        touched: dict[str, _RequestState] = {}
        failed: list[tuple[str, RequestError]] = []
        for output in outputs:
            entry = self._by_core_id.get(output.request_id)
            if entry is None:
                continue  # aborted in the frontend while the step ran
            state, completion = entry
            if output.finish_reason == FinishReason.ERROR:
                request_id = state.request.request_id
                siblings, _ = self.abort_request(request_id)
                to_abort.extend(core_id for core_id in siblings if core_id != output.request_id)
                touched.pop(request_id, None)
                failed.append((request_id, RequestError(output.error or "the engine could not run this request",
                                                        field=output.error_field)))
                continue
            state.num_cached_tokens = output.num_cached_tokens
            if self._apply(completion, output):
                to_abort.append(completion.core_request_id)
            if completion.finished:
                del self._by_core_id[completion.core_request_id]
            touched[state.request.request_id] = state
        request_outputs = []
        for request_id, state in touched.items():
            request_output = self._make_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finished:
                del self._requests[request_id]
        return ProcessedOutputs(request_outputs, to_abort, failed)

    # -- helpers -----------------------------------------------------------------------------------------

    def _apply(self, completion: _Completion, output: EngineCoreOutput) -> bool:
        """Fold one step's tokens into `completion`. True when a stop string ended it here."""
        completion.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None and completion.logprobs is not None:
            for token_ids, values in output.new_logprobs:
                completion.logprobs.append(dict(zip(token_ids, values)))
                completion.cumulative_logprob += values[0]
        stopped_here = False
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            text_token_ids = output.new_token_ids
            if output.finish_reason == FinishReason.STOP and not completion.include_stop_str_in_output:
                # The EOS or stop token that ended the completion is not part of its text (vLLM's rule),
                # even with skip_special_tokens=False.
                text_token_ids = text_token_ids[:-1]
            # Stop strings count only once min_tokens tokens exist, as vLLM does.
            update = detokenizer.update(text_token_ids, check_stop=len(completion.token_ids) > completion.min_tokens)
            completion.text += update.delta_text
            if update.stop_str is not None:
                completion.finish_reason = FinishReason.STOP
                completion.stop_reason = update.stop_str
                stopped_here = not output.finished
                return stopped_here
        if output.finished:
            if detokenizer is not None:
                completion.text += detokenizer.flush()
            completion.finish_reason = output.finish_reason
            completion.stop_reason = output.stop_reason
        return stopped_here

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        if state.kind is OutputKind.FINAL_ONLY:
            if not state.finished:
                return None
            completions = [self._completion_output(c, full=True) for c in state.completions]
        else:
            completions = [self._completion_output(c, full=False) for c in state.completions if c.has_news()]
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _completion_output(completion: _Completion, *, full: bool) -> CompletionOutput:
        token_start = 0 if full else completion.sent_tokens
        text_start = 0 if full else completion.sent_text
        logprobs = None if completion.logprobs is None else completion.logprobs[token_start:]
        result = CompletionOutput(
            index=completion.index,
            text=completion.text[text_start:],
            token_ids=completion.token_ids[token_start:],
            logprobs=logprobs,
            cumulative_logprob=completion.cumulative_logprob,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        completion.sent_tokens = len(completion.token_ids)
        completion.sent_text = len(completion.text)
        completion.sent_final = completion.finished
        return result
