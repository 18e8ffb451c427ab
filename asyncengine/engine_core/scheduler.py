"""Scheduler: continuous batching with a token budget, chunked prefill and preemption; the built-in
SchedulerInterface (asyncengine/interfaces/scheduler.py, which says how the engine core builds it).

It supports async scheduling: step N+1 may be scheduled before step N's sampled tokens are folded
in. A sequence counts the tokens it will sample in steps still in flight (`num_pending_tokens`); the
worker knows those tokens itself when it runs the next step, so the scheduler never needs their values.

Each step spends at most `max_num_batched_tokens` tokens. Running sequences come first, oldest first
(one token each when decoding, the next chunk when a long prompt is still being prefilled); waiting
sequences are admitted after them while the budget, `max_num_seqs` and free KV blocks allow. When a
running sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed and it is recomputed later (its prefix may still be in the cache).

With `policy` "priority" (vLLM's --scheduling-policy priority; docs/server.md, "Priority") the waiting
queue and the running list are kept in (priority, arrival) order, a lower value first: the step serves
the most urgent first, and the running sequence preempted (the last) is the one with the highest value
and the latest arrival. Running sequences are never preempted for a
waiting one (as in vLLM): priority decides who gets the next free slot, and who loses one.

Fairness between requests (docs/server.md, "Fairness"): the sequences of one request (sharing a
`parent_id`: its `n` completions, and over HTTP every prompt of one completions request) never hold
more than half of the slots at once (`max_num_seqs // 2`, at least 1), alone in the engine or not, so a
request arriving behind a large fan-out finds a free slot at the next step. While any other request
waits they also get at most half of a step's token budget (with nobody else waiting they may take the
whole step's tokens). Their sequences beyond the share stay waiting, keeping their place, and later
requests are admitted past them.

A request a worker could not take (ModelRunnerOutput.failed_requests) finishes with finish_reason
"error" and the worker's message; the other requests and the engine go on.

With a KV connector (`kv_connector`, its scheduler side; given by the engine core from kv_transfer_config),
a request being admitted asks it for the prompt tokens it can supply after the local prefix cache's;
those count as computed, the connector's worker side fills their blocks before the step's forward pass,
and every step carries the connector's metadata to the workers (interfaces/kv_connector.py).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Iterable

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.encoder_cache import EncoderCacheManager
from asyncengine.engine_core.micro_batches import MicroBatches
from asyncengine.engine_core.sequence import Sequence, SequenceStatus
from asyncengine.interfaces.kv_connector import KVConnectorBase, KVConnectorRequest
from asyncengine.interfaces.scheduler import SchedulerInterface
from asyncengine.structured_output.backend import GrammarBroken
from asyncengine.structured_output.manager import StructuredOutputManager
from asyncengine.wire.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from asyncengine.wire.worker import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        *,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        structured_output: StructuredOutputManager | None = None,
        kv_connector: KVConnectorBase | None = None,
        max_loras: int | None = None,
        micro_batches: MicroBatches | None = None,
        max_num_encoder_input_tokens: int | None = None,
        encoder_cache_size: int | None = None,
    ) -> None:
        # The arguments are the engine core's, the same for every scheduler_cls (interfaces/scheduler.py).
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # "fcfs" or "priority" (see above; scheduling_policy).
        self.policy = policy
        # Structured outputs (structured_output/manager.py): grammars and matchers of constrained requests,
        # which wait here until theirs is compiled; None when no request can be constrained (tests).
        self.structured_output = structured_output
        # The scheduler side of the KV connector (interfaces/kv_connector.py), or None.
        self.kv_connector = kv_connector
        # Multi-LoRA: at most this many distinct adapters among the running sequences (the workers' slots);
        # None without LoRA.
        self.max_loras = max_loras
        # Pipeline micro-batches (engine_core/micro_batches.py); None without pipeline stages to overlap.
        self.micro_batches = micro_batches
        # Multimodal items' encoder work and outputs (engine_core/encoder_cache.py); both limits default to the
        # step's token budget, as vLLM's do.
        self.encoder_cache = EncoderCacheManager(encoder_cache_size or max_num_batched_tokens,
                                                 max_num_encoder_input_tokens or max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._num_arrivals = 0
        self._admitted: list[str] = []  # first admissions since the last update_from_output
        # Sequences the worker does not know yet (new, or resumed after preemption).
        self._unsent: set[str] = set()
        # Sequences the worker must forget at the next step.
        self._forget: list[str] = []
        self.num_prompt_tokens_computed = 0
        self.num_kv_connector_loaded_tokens = 0
        # Sequence id -> its parent request's id: the completions of a request with n > 1, the prompts of
        # one HTTP completions request (EngineCoreRequest.parent_id).
        self._parent_of: dict[str, str] = {}

    # -- requests in and out -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.sequences:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        seq = Sequence(request, self.block_manager.block_size, self._num_arrivals,
                       self.block_manager.num_groups)
        self._num_arrivals += 1
        self.sequences[seq.request_id] = seq
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.append(seq)
        self._unsent.add(seq.request_id)
        if request.parent_id is not None:
            self._parent_of[seq.request_id] = request.parent_id

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: str = FinishReason.ABORT) -> list[str]:
        """Finish the given requests (every one for None) with `finished_status`, "abort" unless told,
        freeing their blocks. Unknown ids are ignored (the request may have finished on its own a moment
        earlier). Returns the ids finished."""
        if request_ids is None:
            request_ids = list(self.sequences)
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            seq = self.sequences.get(request_id)
            if seq is None:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, finished_status)
            finished.append(request_id)
        return finished

    def get_num_unfinished_requests(self) -> int:
        return len(self.sequences)

    def has_unfinished_requests(self) -> bool:  # (the interface's, without a call: the step loop asks often)
        return bool(self.sequences)

    def has_finished_requests(self) -> bool:
        return bool(self._forget)

    def reset_prefix_cache(self) -> bool:
        self.block_manager.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Nothing to release: the blocks are the workers' memory, the grammars the engine core's."""

    # -- one step ----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        preempted_this_step = False

        shares = _Shares(self) if self._parent_of else None
        encoder = self.encoder_cache
        encoder.begin_step(self.running)
        micro_batches = self.micro_batches
        if micro_batches is not None:
            micro_batches.begin_step(len(self.running))

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens_with_pending - seq.num_computed_tokens, budget)
            if shares is not None:
                num_new = min(num_new, shares.tokens_left(seq))
            needed: list[int] = []
            if seq.mm_features and num_new > 0:  # its chunk stops before an image the encoder cannot take now
                num_new, needed = encoder.plan(seq, seq.num_computed_tokens, num_new)
            if (num_new <= 0 or self._will_finish_by_length(seq) or self._awaits_grammar_token(seq)
                    or (micro_batches is not None and micro_batches.sits_out(seq))):
                index += 1  # its last token is still in flight (or its request used its share): nothing now
                continue
            num_blocks_before = [len(table) for table in seq.block_tables]
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()  # the last: latest admitted (fcfs), least urgent (priority)
                self._preempt(victim)
                preempted_this_step = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it is running any more
            if needed:
                encoder.commit(seq, needed)
            scheduled[seq.request_id] = num_new
            budget -= num_new
            if shares is not None:
                shares.spend(seq, num_new)
            if seq.request_id in self._unsent:
                new_requests.append(self._new_request_data(seq))
            else:
                cached_requests.append(
                    CachedRequestData(
                        request_id=seq.request_id,
                        new_block_ids=seq.block_ids[num_blocks_before[0]:],
                        num_computed_tokens=seq.num_computed_tokens,
                        extra_group_block_ids=[table[before:] for table, before in
                                               zip(seq.block_tables[1:], num_blocks_before[1:])] or None,
                    )
                )
            index += 1

        # Admit waiting sequences, unless this step already had to preempt: admitting now would only
        # take blocks the preempted sequences need back.
        deferred: list[Sequence] = []  # past their request's share while others wait: they keep their place
        active_loras = ({seq.lora_int_id for seq in self.running if seq.lora_int_id}
                        if self.max_loras is not None else set())
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted_this_step:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while a step computing it was in flight: resume once it is back
            if self.structured_output is not None and not self.structured_output.is_ready(seq.request_id):
                deferred.append(self.waiting.popleft())  # its grammar is compiling: others go first
                continue
            if (self.max_loras is not None and seq.lora_int_id and seq.lora_int_id not in active_loras
                    and len(active_loras) >= self.max_loras):
                deferred.append(self.waiting.popleft())  # its adapter has no slot while max_loras others run
                continue
            limit = budget if shares is None else min(budget, shares.admission_tokens_left(seq))
            if limit <= 0:
                deferred.append(self.waiting.popleft())
                continue
            # A pooling request needs every prompt token's hidden state: no prefix cache, no chunks.
            cached_groups = self.block_manager.cached_prefix(seq) if seq.pooling is None else None
            num_cached = len(cached_groups[0]) * self.block_manager.block_size if cached_groups else 0
            num_external = self._external_tokens(seq, num_cached) if self.kv_connector is not None else 0
            num_new = seq.num_tokens - num_cached - num_external
            if num_new > limit:
                if not self.enable_chunked_prefill or seq.pooling is not None:
                    if limit < budget:  # its share, not the step, is what it lacks
                        deferred.append(self.waiting.popleft())
                        continue
                    break
                num_new = limit
            needed = []
            if seq.mm_features:
                whole = num_new
                num_new, needed = encoder.plan(seq, num_cached + num_external, num_new)
                if num_new <= 0 or (num_new < whole and not self.enable_chunked_prefill):
                    break  # an image it reaches waits for the encoder budget or cache: it waits its turn
            if not self.block_manager.allocate(seq, num_external + num_new, cached_groups=cached_groups):
                break
            if needed:
                encoder.commit(seq, needed)
            self.waiting.popleft()
            if shares is not None:
                shares.admit(seq, num_new)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached)
                self._admitted.append(seq.request_id)
            seq.num_computed_tokens = num_cached + num_external
            seq.num_external_tokens = num_external
            if num_external and self.kv_connector is not None:  # only a connector supplies tokens
                self.num_kv_connector_loaded_tokens += num_external
                self.kv_connector.update_state_after_alloc(self._connector_view(seq, num_computed=num_cached),
                                                           num_external)
            if seq.lora_int_id:
                active_loras.add(seq.lora_int_id)
            seq.status = SequenceStatus.RUNNING
            if self.policy == "priority":
                bisect.insort(self.running, seq, key=_priority_order)
            else:
                self.running.append(seq)
            scheduled[seq.request_id] = num_new
            budget -= num_new
            new_requests.append(self._new_request_data(seq))
        self.waiting.extendleft(reversed(deferred))

        # Tokens scheduled now count as computed from here on; a sequence whose scheduled tokens reach
        # its end samples one token, appended when the step's output comes back.
        connector = self.kv_connector
        views: list[KVConnectorRequest] | None = [] if connector is not None else None
        sampling_ids: list[str] = []
        for request_id, num_tokens in scheduled.items():
            seq = self.sequences[request_id]
            start = seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + num_tokens, seq.num_prompt_tokens) - start)
            if views is not None:
                views.append(self._connector_view(seq, num_computed=start, num_scheduled=num_tokens))
            seq.num_computed_tokens += num_tokens
            if seq.num_computed_tokens == seq.num_tokens_with_pending and seq.pooling is None:
                seq.num_pending_tokens += 1
                sampling_ids.append(request_id)
        defer_masks = self._defers_masks(sampling_ids)
        forget, self._forget = self._forget, []
        metadata = None
        if connector is not None and views is not None:
            built = connector.build_connector_meta(views)
            metadata = None if built is None else connector.encode_metadata(built)
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=scheduled,
            finished_request_ids=forget,
            kv_connector_metadata=metadata,
            grammar_bitmask=None if defer_masks else self._grammar_bitmask(sampling_ids),
            deferred_grammar_request_ids=sampling_ids if defer_masks else None,
            pipeline_token_ids=(None if micro_batches is None
                                else micro_batches.token_ids(cached_requests, self.sequences)),
            scheduled_encoder_inputs=encoder.scheduled_encoder_inputs(),
            free_encoder_mm_hashes=encoder.take_freed(),
        )

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        logprobs = runner_output.logprobs
        for position, request_id in enumerate(runner_output.request_ids):
            seq = self.sequences.get(request_id)
            if seq is None:
                continue  # finished or aborted while the step ran
            seq.num_pending_tokens -= 1
            token_id = runner_output.sampled_token_ids[position]
            seq.append_token(token_id)
            # The grammar first: a token from a mask that allowed none is not the output's, whatever else it is
            # (an EOS, the last token of max_tokens).
            try:
                grammar_complete = self.structured_output is not None and self.structured_output.accept(
                    request_id, token_id)
            except GrammarBroken as broken:  # the request ends with the error, never unconstrained
                failed = self.fail_request(request_id, broken.message, broken.field)
                if failed is not None:
                    outputs.append(failed)
                continue
            finish_reason, stop_reason = self._check_stop(seq, token_id)
            if finish_reason is None and grammar_complete:
                finish_reason = FinishReason.STOP  # its grammar is complete
            token_logprobs = logprobs[position] if logprobs is not None else None
            output = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[token_id],
                new_logprobs=[token_logprobs] if token_logprobs else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_cached_tokens=seq.num_cached_tokens,
            )
            outputs.append(output)
            if finish_reason is not None:
                # A sequence preempted while this step ran sits in the waiting queue.
                (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
                self._finish(seq, finish_reason, stop_reason)
        for request_id, pooled in zip(runner_output.pooled_request_ids, runner_output.pooled):
            seq = self.sequences.get(request_id)
            if seq is None:
                continue  # aborted while the step ran
            (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
            self._finish(seq, FinishReason.STOP)  # a pooling request ends with its prefill: its blocks are free
            outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.STOP,
                                            pooled=pooled))
        for failure in runner_output.failed_requests:
            seq = self.sequences.get(failure.request_id)
            if seq is None:
                continue  # finished or aborted meanwhile
            (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
            self._finish(seq, FinishReason.ERROR)
            outputs.append(EngineCoreOutput(request_id=failure.request_id, new_token_ids=[],
                                            finish_reason=FinishReason.ERROR, error=failure.message,
                                            error_field=failure.field, num_cached_tokens=seq.num_cached_tokens))
        admitted, self._admitted = self._admitted, []
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats(),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            admitted_request_ids=admitted,
        )

    def make_stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=manager.usage,
            num_blocks=manager.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_kv_connector_loaded_tokens=self.num_kv_connector_loaded_tokens,
            structured_outputs_cache_bytes=self.structured_output.cache_bytes if self.structured_output else 0,
            structured_outputs_cache_entries=self.structured_output.cache_entries if self.structured_output else 0,
            encoder_cache_entries=self.encoder_cache.num_entries,
            encoder_cache_rows=self.encoder_cache.num_cached_rows,
        )

    # -- helpers -----------------------------------------------------------------------------------------

    def _will_finish_by_length(self, seq: Sequence) -> bool:
        """True when the tokens in flight already take the sequence to max_tokens or max_model_len."""
        if not seq.num_pending_tokens:
            return False
        num_outputs = seq.num_output_tokens + seq.num_pending_tokens
        return num_outputs >= seq.sampling.max_tokens or seq.num_tokens_with_pending >= self.max_model_len

    def _check_stop(self, seq: Sequence, token_id: int) -> tuple[str | None, int | None]:
        sampling = seq.sampling
        at_length = seq.num_output_tokens >= sampling.max_tokens or seq.num_tokens >= self.max_model_len
        if seq.num_output_tokens >= sampling.min_tokens:
            if token_id in sampling.stop_token_ids:
                return FinishReason.STOP, token_id
            if token_id in sampling.eos_token_ids:
                return FinishReason.STOP, None
        if at_length:
            return FinishReason.LENGTH, None
        return None, None

    def _awaits_grammar_token(self, seq: Sequence) -> bool:
        """A constrained sequence's next mask needs its token still in flight, and it joins the other
        constrained ones in one step (StructuredOutputManager.sits_out): it sits this step out."""
        return (self.structured_output is not None
                and self.structured_output.sits_out(seq.request_id, seq.num_pending_tokens))

    def _defers_masks(self, sampling_ids: list[str]) -> bool:
        """Whether this step's masks must wait until the step in flight is folded in: the executor takes
        them late (split step, structured_output/deferred.py) and a constrained request sampling now
        has its previous token in flight (this step's own counts already, so more than one pending)."""
        manager = self.structured_output
        return (manager is not None and manager.deferred_masks and manager.num_constrained > 0
                and any(manager.is_constrained(rid) and self.sequences[rid].num_pending_tokens > 1
                        for rid in sampling_ids))

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        return self._grammar_bitmask(scheduler_output.deferred_grammar_request_ids or [])

    def _grammar_bitmask(self, sampling_ids: list[str]) -> GrammarBitmask | None:
        """The masks of those of `sampling_ids` that are constrained, from their matchers' state now."""
        if self.structured_output is None:
            return None
        masks = self.structured_output.bitmask(sampling_ids)
        if masks is None:
            return None
        request_ids, words = masks
        return GrammarBitmask(request_ids=request_ids, words=words, num_words=self.structured_output.num_words)

    def fail_request(self, request_id: str, message: str, field: str | None) -> EngineCoreOutput | None:
        """Finish a request with "error" (its grammar was refused, or could not go on); None if it is gone."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self._finish(seq, FinishReason.ERROR)
        return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                error=message, error_field=field, num_cached_tokens=seq.num_cached_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.encoder_refs:
            self.encoder_cache.release_all(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":  # back in its place by (priority, arrival): ahead of later and lesser ones
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.appendleft(seq)
        self._unsent.add(seq.request_id)
        self._forget.append(seq.request_id)

    def _external_tokens(self, seq: Sequence, num_cached: int) -> int:
        """The prompt tokens after the first `num_cached` that the KV connector supplies: never the last
        prompt token (its logits are needed), so a larger answer is cut to leave it."""
        connector = self.kv_connector
        if connector is None:
            return 0
        num = connector.get_num_new_matched_tokens(self._connector_view(seq, num_computed=num_cached), num_cached)
        if not isinstance(num, int) or isinstance(num, bool) or num < 0:
            raise ValueError(f"KV connector {type(connector).__qualname__}.get_num_new_matched_tokens returned "
                             f"{num!r} for request {seq.request_id!r}: it must return a count of tokens (an int >= 0)")
        return min(num, max(0, seq.num_prompt_tokens - 1 - num_cached))

    def _connector_view(self, seq: Sequence, *, num_computed: int, num_scheduled: int = 0) -> KVConnectorRequest:
        num_prompt = seq.num_prompt_tokens
        return KVConnectorRequest(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[:num_prompt],
            block_hashes=seq.block_hashes()[: num_prompt // self.block_manager.block_size],
            block_ids=seq.block_ids,
            num_computed_tokens=num_computed,
            num_scheduled_tokens=num_scheduled,
            num_external_tokens=seq.num_external_tokens,
        )

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        if self.kv_connector is not None:
            self.kv_connector.request_finished(self._connector_view(seq, num_computed=seq.num_computed_tokens))
        self.block_manager.free(seq)
        if seq.encoder_refs:
            self.encoder_cache.release_all(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        del self.sequences[seq.request_id]
        self._parent_of.pop(seq.request_id, None)
        if self.structured_output is not None:
            self.structured_output.remove(seq.request_id)
        if seq.request_id in self._unsent:
            self._unsent.discard(seq.request_id)
        else:
            self._forget.append(seq.request_id)

    def _new_request_data(self, seq: Sequence) -> NewRequestData:
        self._unsent.discard(seq.request_id)
        return NewRequestData(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            output_token_ids=seq.output_token_ids,
            sampling=seq.sampling,
            block_ids=list(seq.block_ids),
            extra_group_block_ids=[list(table) for table in seq.block_tables[1:]] or None,
            num_computed_tokens=seq.num_computed_tokens,
            lora_request=seq.lora_request,
            pooling=seq.pooling,
            mm_features=seq.mm_features or None,
        )


def _priority_order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_index


class _Shares:
    """One step's accounting of what each parent request's sequences hold and take.

    The slots are a hard share: a parent never runs more than `max_seqs` sequences at once, so a slot
    is always left for a request that arrives later. The token budget is held to its share only while
    some sequence that is not the parent's own is waiting (counted as the step goes: those admitted no
    longer wait), so a request alone in the engine prefills at the step's full budget.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._parent_of = scheduler._parent_of
        self.max_seqs = max(1, scheduler.max_num_seqs // 2)
        self.max_tokens = max(1, scheduler.max_num_batched_tokens // 2)
        self.step_budget = scheduler.max_num_batched_tokens
        self.running = Counter(self._parent_of.get(seq.request_id) for seq in scheduler.running)
        self.waiting = Counter(self._parent_of.get(seq.request_id) for seq in scheduler.waiting)
        self.num_waiting = len(scheduler.waiting)
        self.tokens: Counter[str | None] = Counter()

    def _contended(self, parent: str | None) -> bool:
        return parent is not None and self.num_waiting > self.waiting[parent]

    def tokens_left(self, seq: Sequence) -> int:
        """How many tokens `seq` may still be scheduled this step under its parent's share."""
        parent = self._parent_of.get(seq.request_id)
        if not self._contended(parent):
            return self.step_budget  # no share applies: the step's budget is the bound
        return self.max_tokens - self.tokens[parent]

    def admission_tokens_left(self, seq: Sequence) -> int:
        """As `tokens_left`, and 0 once its parent holds its share of the slots (contended or not)."""
        parent = self._parent_of.get(seq.request_id)
        if parent is not None and self.running[parent] >= self.max_seqs:
            return 0
        return self.tokens_left(seq)

    def spend(self, seq: Sequence, num_tokens: int) -> None:
        self.tokens[self._parent_of.get(seq.request_id)] += num_tokens

    def admit(self, seq: Sequence, num_tokens: int) -> None:
        parent = self._parent_of.get(seq.request_id)
        self.running[parent] += 1
        self.waiting[parent] -= 1
        self.num_waiting -= 1
        self.spend(seq, num_tokens)
