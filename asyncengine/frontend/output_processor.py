"""OutputProcessor: from the engine core's per-step token outputs to RequestOutputs.

It detokenizes incrementally, finds stop strings (then asks for the engine-core request to be
aborted, since the core only knows token-level stops), gathers the `n` completions of a request, and
emits either deltas (streaming) or one final output. It keeps no table of requests: each request's
state (a RequestOutputState, a generation's RequestOutputs) lives in its RequestRecord
(request_state.py), whose table calls `apply` for each engine-core output and `make_output` once per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from asyncengine.errors import RequestError
from asyncengine.frontend.detokenizer import IncrementalDetokenizer
from asyncengine.frontend.processor import ProcessedRequest
from asyncengine.frontend.request_state import RequestOutputs
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.wire.engine_core import EngineCoreOutput, FinishReason


class OutputKind(enum.Enum):
    DELTA = "delta"  # each output carries what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, when every completion has finished


@dataclass
class CompletionState:
    """One completion of a request: its tokens and text so far, and how much of them was sent."""

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
class RequestOutputState(RequestOutputs):
    """What the output processor keeps for one generation request (its RequestRecord holds it)."""

    processor: OutputProcessor
    request: ProcessedRequest
    kind: OutputKind
    completions: list[CompletionState]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def failure(self, output: EngineCoreOutput) -> BaseException | None:
        return self.processor.error_of(output) if output.finish_reason == FinishReason.ERROR else None

    def apply(self, completion: CompletionState, output: EngineCoreOutput) -> bool:
        return self.processor.apply(completion, output)

    def make_output(self) -> RequestOutput | None:
        return self.processor.make_output(self)

    def abort(self) -> RequestOutput | None:
        return self.processor.abort(self)


class OutputProcessor:
    """Stateless but for the tokenizer: each request's state is a RequestOutputState, kept by its record."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def new_state(self, request: ProcessedRequest, kind: OutputKind) -> RequestOutputState:
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
            completions.append(CompletionState(
                index=index,
                core_request_id=child.request_id,
                detokenizer=detokenizer,
                min_tokens=params.min_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            ))
        return RequestOutputState(self, request, kind, completions)

    def abort(self, state: RequestOutputState) -> RequestOutput | None:
        """End the unfinished completions with finish_reason "abort"; the request's last output."""
        for completion in state.completions:
            if not completion.finished:
                if completion.detokenizer is not None:
                    completion.text += completion.detokenizer.flush()
                completion.finish_reason = FinishReason.ABORT
        return self.make_output(state)

    @staticmethod
    def error_of(output: EngineCoreOutput) -> RequestError:
        """The error a request's consumer gets when one of its completions failed in the engine."""
        return RequestError(output.error or "the engine could not run this request", field=output.error_field)

    # -- helpers -----------------------------------------------------------------------------------------

    def apply(self, completion: CompletionState, output: EngineCoreOutput) -> bool:
        """Fold one step's tokens into `completion`. True when a stop string ended it here."""
        completion.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None and completion.logprobs is not None:
            for token_ids, values in output.new_logprobs:
                completion.logprobs.append(dict(zip(token_ids, values)))
                # (set to 0.0 with the logprobs list, when the request asked for logprobs)
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + values[0]
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

    def make_output(self, state: RequestOutputState) -> RequestOutput | None:
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
    def _completion_output(completion: CompletionState, *, full: bool) -> CompletionOutput:
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
