"""The frontend's side of pooling requests (embed, classify, score, encode): checked and tokenized here, sent
to the engine core as prefill-only requests, answered with one pooled output each (docs/pooling.md).

`PoolingProcessor` checks and tokenizes (`prepare_pooling`, in the tokenizer pool) and makes the request;
`PoolingOutputs` is what a pooling request makes of its engine-core output: the kind of request the
AsyncEngine's one RequestTable holds beside generations (request_state.py). AsyncEngine's `encode(prompt,
pooling_params)` (vLLM's name; an async generator that yields the one final PoolingRequestOutput) and `pool(...)`,
its coroutine form, run it as they run a generation: the same admission, the same abort path (cancelling the
waiting task, or `abort(request_id)`, aborts it in the engine core), the same step handler; the engine's death
fails it.

A pooling request takes a place under `max_waiting_requests` as a generation does (the same AdmissionGate,
frontend/admission.py) and holds it until the scheduler first runs it (the step that first runs a pooling
request also finishes it): it waits for room, or with `nowait` (the server) fails with EngineOverloadedError
at once, a 503.

Every check of a request raises RequestError naming the field (the server's 400): an empty prompt, a token id
outside the vocabulary, a prompt longer than max_model_len without `truncate_prompt_tokens`, `dimensions` on a
model that is not Matryoshka, a task the model cannot do.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.errors import RequestError
from asyncengine.frontend.request_state import RequestOutputs
from asyncengine.frontend.tokenizer import encode_text
from asyncengine.pooling.outputs import PoolingOutput, PoolingRequestOutput, tensor_of
from asyncengine.pooling.params import PoolingParams
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingOptions
from asyncengine.wire.pooling import PoolingOptions

_NO_SAMPLING = SamplingOptions(max_tokens=1)


@dataclass
class PoolingPrompt:
    """A pooling request, checked and tokenized: what goes to the engine core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    options: PoolingOptions


@dataclass
class PoolingCompletion:
    """A pooling request's one engine-core request, as the request table sees it."""

    core_request_id: str
    finished: bool = False


class PoolingOutputs(RequestOutputs):
    """A pooling request's outputs: the one pooled vector (or scores) its engine-core request ends with."""

    counted_in_stats = False  # the stat loggers count generated tokens and their latencies: a pooling has none

    def __init__(self, request_id: str, core_request_id: str, prepared: PoolingPrompt) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self.completions = [PoolingCompletion(core_request_id)]
        self.num_cached_tokens = 0
        self._output: EngineCoreOutput | None = None

    @property
    def finished(self) -> bool:
        return bool(self.completions[0].finished)

    def failure(self, output: EngineCoreOutput) -> BaseException | None:
        if output.finish_reason == FinishReason.ERROR:
            return RequestError(output.error or "the engine could not pool this request", field=output.error_field)
        if output.pooled is None:
            return RequestError(f"the pooling request ended ({output.finish_reason}) without an output")
        return None

    def apply(self, completion: PoolingCompletion, output: EngineCoreOutput) -> bool:
        if output.finished:
            completion.finished = True
            self._output = output
        return False

    def make_output(self) -> PoolingRequestOutput | None:
        output = self._output
        if output is None or output.pooled is None:  # (failure() ended a finished one without a vector)
            return None
        prepared = self.prepared
        return PoolingRequestOutput(request_id=self.request_id, outputs=PoolingOutput(tensor_of(output.pooled)),
                                    prompt_token_ids=prepared.prompt_token_ids, prompt=prepared.prompt)

    def abort(self) -> RequestError:
        return RequestError(f"pooling request {self.request_id!r} was aborted", field="request_id")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class PoolingProcessor:
    """Pooling requests checked and tokenized against the model, and made into a request for the table."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._numbers = itertools.count()

    # -- checking and tokenizing ------------------------------------------------------------------------

    def pooling_task_default(self) -> str:
        pooler = self.model_config.pooler
        return "classify" if pooler is not None and pooler.is_classifier else "embed"

    def check_pooling_task(self, task: str) -> None:
        model_config = self.model_config
        pooler = model_config.pooler
        if pooler is None:
            raise RequestError(f"model {model_config.served_model_name} cannot pool: its files ask for a pooling "
                               "asyncengine does not do (start it with --runner pooling to see why)", field="model")
        if task in ("classify", "score", "token_classify") and not pooler.is_classifier:
            raise RequestError(f"task {task!r} needs a classification model (*ForSequenceClassification); "
                               f"{model_config.served_model_name} is an embedding model", field="task")
        if task in ("embed", "token_embed") and pooler.is_classifier:
            raise RequestError(f"{model_config.served_model_name} is a classifier: use classify, score or "
                               f"token_classify, not {task}", field="task")

    def prepare_pooling(self, prompt: Any, params: PoolingParams | None, *, task: str | None = None,
                        pair: Any = None, field: str = "prompt") -> PoolingPrompt:
        """Check and tokenize one pooling request (in the tokenizer pool: it may tokenize). `pair`: the second
        text of a cross-encoder's pair (tokenized with the first, BERT's segment ids set). `field` names the
        prompt in errors ("input" for the server's embeddings)."""
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise RequestError(f"pooling_params must be a PoolingParams, got {type(params).__name__}",
                               field="pooling_params")
        task = task or params.task or self.pooling_task_default()
        if task == "plugin":  # vLLM's task of an IO processor's requests: the model's own
            task = self.pooling_task_default()
        self.check_pooling_task(task)
        model_config = self.model_config
        pooler = model_config.pooler
        if pooler is None:  # (check_pooling_task refused it)
            raise RequestError("this model cannot pool", field="model")
        if params.dimensions is not None:
            if not pooler.matryoshka:
                raise RequestError(f"dimensions is set, but {model_config.served_model_name} is not a Matryoshka "
                                   "model (its config.json says neither is_matryoshka nor matryoshka_dimensions): "
                                   "leave dimensions out", field="dimensions")
            hidden = int(model_config.hf_config.get("hidden_size") or 0)
            if hidden and params.dimensions > hidden:
                raise RequestError(f"dimensions={params.dimensions} exceeds the embedding size ({hidden})",
                                   field="dimensions")
        max_len = model_config.max_model_len
        truncate = params.truncate_prompt_tokens
        if truncate is not None and truncate > max_len:
            raise RequestError(f"truncate_prompt_tokens={truncate} exceeds max_model_len ({max_len})",
                               field="truncate_prompt_tokens")
        limit = max_len if truncate == -1 else truncate
        text, token_ids, token_types = self._pooling_tokens(prompt, pair, limit, field)
        if not token_ids:
            raise RequestError(f"{field} is empty: send some text or token ids", field=field)
        vocab = model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} in {field} is outside the vocabulary (0..{vocab - 1})", field=field)
        budget = min(max_len, self.config.effective_max_num_batched_tokens)
        if len(token_ids) > budget:
            why = (f"max_model_len ({max_len})" if budget == max_len
                   else f"max_num_batched_tokens ({budget}; a pooling prompt runs in one step)")
            raise RequestError(f"{field} has {len(token_ids)} tokens, more than {why}: shorten it, or set "
                               "truncate_prompt_tokens", field=field, code="context_length_exceeded")
        normalize = pooler.normalize if params.normalize is None else params.normalize
        options = PoolingOptions(task=task, dimensions=params.dimensions, normalize=normalize,
                                 activation=params.use_activation is not False, token_type_ids=token_types)
        return PoolingPrompt(request_id="", prompt=text, prompt_token_ids=token_ids, options=options)

    def _pooling_tokens(self, prompt: Any, pair: Any, limit: int | None,
                        field: str) -> tuple[str | None, list[int], list[int] | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
        if _is_token_ids(prompt) and pair is None:
            ids = list(prompt)
            return None, (ids[:limit] if limit is not None else ids), None
        tokenizer = self.tokenizer
        if not isinstance(prompt, str) or (pair is not None and not isinstance(pair, str)):
            raise RequestError(f"{field} must be a string or a list of token ids, got {type(prompt).__name__}",
                               field=field)
        if tokenizer is None:
            raise RequestError("this engine runs with skip_tokenizer_init: send token ids", field=field)
        if pair is None and limit is None:
            return prompt, encode_text(tokenizer, prompt), None
        # A pair (BERT's segment ids), or truncation at the tokenizer's side (it keeps the special tokens).
        kwargs: dict[str, Any] = {"truncation": True, "max_length": limit} if limit is not None else {}
        encoded = tokenizer(prompt, pair, **kwargs) if pair is not None else tokenizer(prompt, **kwargs)
        types = encoded.get("token_type_ids") if pair is not None else None
        return prompt, list(encoded["input_ids"]), (list(types) if types and any(types) else None)

    # -- running ----------------------------------------------------------------------------------------

    def check_fits_the_queue(self, count: int, field: str) -> None:
        """`count` pooling requests sent at once without waiting (nowait) can never all get a place when they
        outnumber max_waiting_requests: a RequestError naming `field` (as for generation's n)."""
        capacity = self.config.max_waiting_requests
        if count > capacity:
            raise RequestError(f"{field} has {count} inputs, more than max_waiting_requests ({capacity}) can hold: "
                               "send fewer per request", field=field)

    def new_request(self, prepared: PoolingPrompt,
                    request_id: str | None) -> tuple[str, list[EngineCoreRequest], PoolingOutputs]:
        """A prepared pooling request as the request table opens it: its id (`pool-N` unless given), its one
        prefill-only engine-core request and its outputs."""
        number = next(self._numbers)
        request_id = request_id if request_id is not None else f"pool-{number}"
        core_id = f"{number}:pool:{request_id}"
        request = EngineCoreRequest(request_id=core_id, prompt_token_ids=prepared.prompt_token_ids,
                                    sampling=_NO_SAMPLING, arrival_time=time.monotonic(), pooling=prepared.options)
        return request_id, [request], PoolingOutputs(request_id, core_id, prepared)
