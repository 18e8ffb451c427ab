"""The frontend's side of pooling requests (embed, classify, score, encode): checked and tokenized here, sent
to the engine core as prefill-only requests, answered with one pooled output each (docs/pooling.md).

`PoolingEngine` is mixed into AsyncEngine: `encode(prompt, pooling_params)` (vLLM's name; an async generator
that yields the one final PoolingRequestOutput) and `pool(...)`, its coroutine form. A pooling request is one
engine-core request, tracked by the `PoolingTable` until its output (or error) arrives; cancelling the waiting
task aborts it in the engine core, and the engine's death fails it.

A pooling request takes a place under `max_waiting_requests` as a generation does (the same AdmissionGate,
frontend/admission.py) and holds it until its output arrives (the step that first runs a pooling request also
finishes it): it waits for room, or with `nowait` (the server) fails with EngineOverloadedError at once, a 503.

Every check of a request raises RequestError naming the field (the server's 400): an empty prompt, a token id
outside the vocabulary, a prompt longer than max_model_len without `truncate_prompt_tokens`, `dimensions` on a
model that is not Matryoshka, a task the model cannot do.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator

import anyio

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError
from asyncengine.frontend.admission import AdmissionGate
from asyncengine.frontend.core_client import CoreClient
from asyncengine.frontend.request_state import RequestTable
from asyncengine.frontend.tokenizer_pool import TokenizerPool
from asyncengine.frontend.tokenizer import encode_text
from asyncengine.pooling.outputs import PoolingOutput, PoolingRequestOutput, tensor_of
from asyncengine.pooling.params import PoolingParams
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingOptions
from asyncengine.wire.messages import AbortRequests, AddRequests
from asyncengine.wire.pooling import PoolingOptions

_NO_SAMPLING = SamplingOptions(max_tokens=1)


@dataclass
class PoolingPrompt:
    """A pooling request, checked and tokenized: what goes to the engine core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    options: PoolingOptions


class _Pending:
    __slots__ = ("done", "output", "error", "holds_place")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.output: EngineCoreOutput | None = None
        self.error: BaseException | None = None
        self.holds_place = True  # its place at the admission gate, until it is given back


class PoolingTable:
    """Pooling requests in the engine core, by engine-core id, until their one output arrives. Each holds one
    place at `gate` (taken before `open`), given back when its output arrives or it is forgotten."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def take_place(self, *, nowait: bool) -> None:
        """One place at the gate for a pooling request: wait for it, or with `nowait` raise
        EngineOverloadedError when every place is taken (as a generation request does)."""
        if not nowait:
            await self.gate.enter(1)
        elif not self.gate.try_enter(1):
            raise EngineOverloadedError(
                f"{self.gate.capacity} requests are already waiting (max_waiting_requests); retry later")

    def open(self, core_id: str) -> _Pending:
        """Track a request that has taken its place (`take_place`): the table gives the place back."""
        pending = self._pending[core_id] = _Pending()
        return pending

    def _give_back_place(self, pending: _Pending) -> None:
        if pending.holds_place:
            pending.holds_place = False
            self.gate.leave(1)

    def forget(self, core_id: str) -> bool:
        """Stop tracking a request; True when it was still waiting (so the engine core still has it)."""
        pending = self._pending.pop(core_id, None)
        if pending is None:
            return False
        self._give_back_place(pending)
        return True

    def on_step(self, outputs: list[EngineCoreOutput]) -> None:
        if not self._pending:
            return
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is None or not output.finished:
                continue
            del self._pending[output.request_id]
            self._give_back_place(pending)
            if output.finish_reason == FinishReason.ERROR:
                pending.error = RequestError(output.error or "the engine could not pool this request",
                                             field=output.error_field)
            elif output.pooled is None:
                pending.error = RequestError(f"the pooling request ended ({output.finish_reason}) without an output")
            pending.output = output
            pending.done.set()

    def fail_all(self, error: BaseException) -> None:
        for pending in self._pending.values():
            pending.error = error
            pending.done.set()
        self._pending.clear()


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class PoolingEngine:
    """AsyncEngine's pooling methods (mixed into it: AsyncEngine sets these attributes and defines the two
    methods below, which its own definitions override)."""

    model_config: ModelConfig
    config: EngineConfig
    tokenizer: Any
    tokenizer_pool: TokenizerPool
    _core: CoreClient
    _requests: RequestTable  # the generation requests: its admission gate bounds pooling requests too

    def _check_accepting(self) -> None:
        raise NotImplementedError

    @property
    def dead_error(self) -> EngineDeadError | None:
        raise NotImplementedError

    _pooling_table: PoolingTable | None = None
    _pooling_ids = itertools.count()

    @property
    def pooling_requests(self) -> PoolingTable:
        if self._pooling_table is None:
            self._pooling_table = PoolingTable(self._requests.gate)
        return self._pooling_table

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

    async def pool(self, prompt: Any, pooling_params: PoolingParams | None = None, request_id: str | None = None,
                   *, task: str | None = None, pair: Any = None, field: str = "prompt",
                   nowait: bool = False) -> PoolingRequestOutput:
        """One pooling request, checked, tokenized (in the tokenizer pool) and run; its pooled output. It waits
        for a place under max_waiting_requests, or with `nowait` raises EngineOverloadedError when there is none."""
        self._check_accepting()
        prepared = await self.tokenizer_pool.run(
            self.prepare_pooling, prompt, pooling_params, task=task, pair=pair, field=field)
        return await self.run_pooling(prepared, request_id, nowait=nowait)

    async def run_pooling(self, prepared: PoolingPrompt, request_id: str | None = None, *,
                          nowait: bool = False) -> PoolingRequestOutput:
        number = next(self._pooling_ids)
        request_id = request_id if request_id is not None else f"pool-{number}"
        core_id = f"{number}:pool:{request_id}"
        table = self.pooling_requests
        await table.take_place(nowait=nowait)
        pending = table.open(core_id)  # (no checkpoint between: the place cannot be lost to a cancellation)
        request = EngineCoreRequest(request_id=core_id, prompt_token_ids=prepared.prompt_token_ids,
                                    sampling=_NO_SAMPLING, arrival_time=time.monotonic(), pooling=prepared.options)
        try:
            self._check_accepting()
            await self._core.send(AddRequests(requests=[request]))
            await pending.done.wait()
        finally:
            if table.forget(core_id) and self.dead_error is None:
                with anyio.CancelScope(shield=True):  # cancelled while it ran: free it in the engine core
                    try:
                        await self._core.send(AbortRequests(request_ids=[core_id]))
                    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # the engine core is gone: nothing left to abort
        if pending.error is not None:
            raise pending.error
        output = pending.output
        if output is None or output.pooled is None:  # (on_step sets one of error and output)
            raise RequestError("the pooling request ended without an output")
        return PoolingRequestOutput(request_id=request_id, outputs=PoolingOutput(tensor_of(output.pooled)),
                                    prompt_token_ids=prepared.prompt_token_ids, prompt=prepared.prompt)

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None = None, request_id: str | None = None,
                     *, task: str | None = None) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's AsyncLLM.encode: yields the request's one (final) PoolingRequestOutput."""
        yield await self.pool(prompt, pooling_params, request_id, task=task)
