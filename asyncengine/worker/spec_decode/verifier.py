"""The worker's side of speculative decoding (docs/speculative_decoding.md): the proposer, built through the
proposer registry; the verification of a step's drafts; the proposals after each step.

The model runner runs a step with drafts as one forward over every request's new positions (its last
sampled token, then its drafts: prefill-shaped, through the same attention path) and hands this module the
logits of each request's k + 1 verified positions. Position j of request i is scored with the history
that position has (its output so far plus its first j drafts), so the sampler's steps before the
temperature (logit controls, min_tokens, penalties: `Sampler.before_temperature`) apply per position;
then the target's distributions and the rejection test (rejection_sampler.py). Logprobs are those of the
raw logits at each emitted token's position, as without speculation.

After every step that samples, the proposer drafts for the requests that sampled, over their histories
(prompt, output and the tokens just emitted); the drafts travel to the scheduler, which sends them back
with the request's next step (engine_core/spec_decode.py). A proposer that reads the target's states (EAGLE)
gets each request's rows from every forward (target_states.py); one with a model of its own gets its KV
cache right after the target's, with as many blocks; a request the scheduler drops is forgotten here and by
the proposer (`remove`), its draft blocks freed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.interfaces.registry import reads
from asyncengine.interfaces.spec_decode import (
    PROPOSER_KV_CACHE,
    ProposalBatch,
    Proposer,
    ProposerContext,
    ProposerRegistry,
)
from asyncengine.plugin_runtime.records import current_process_role
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.wire.startup import StartupRecord
from asyncengine.wire.worker import ModelRunnerOutput
from asyncengine.worker.sampler import Sampler, SamplingRow
from asyncengine.worker.spec_decode.rejection_sampler import (
    rejection_sample,
    request_generators,
    target_distributions,
)
from asyncengine.worker.spec_decode.target_states import TargetStates

Logprobs = tuple[list[int], list[float]] | None


class RequestHistory(Protocol):
    """What the verifier reads of a request's worker state (model_runner.RequestState)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingOptions
    logit_controls: Any


@dataclass
class Verified:
    """A step's verification, per request in the step's sampling order: the tokens it emits (its accepted
    drafts, then the target's own token) and, where it asked for them, their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprobs]] | None


class SpecDecoder:
    """One per worker: the proposer of `speculative_config`'s method, with the counts a test or a report reads
    (`num_propose_calls`, `num_proposed_tokens`)."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        started = time.time()
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        proposer_class, owner = proposer_for(config.method)
        self.proposer: Proposer = proposer_class(config, context)
        self.block_size = context.block_size
        # The target's hidden states, for a proposer that reads them (built with the model).
        self.target_states: TargetStates | None = None
        self.num_propose_calls = 0
        self.num_proposed_tokens = 0
        # Drafts' distributions (proposers with has_draft_probs), kept until the step that verifies them.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.record = StartupRecord(
            pid=os.getpid(), role=current_process_role(), phase="load model", plugin="speculative proposer",
            reason=(f"method {config.method}: {proposer_class.__module__}:{proposer_class.__qualname__} "
                    f"(registered by {owner}), num_speculative_tokens={config.num_speculative_tokens}"),
            start=started, duration=time.time() - started)

    def load_model(self, target_model: Any) -> None:
        self.proposer.load_model(target_model)
        if self.proposer.needs_target_hidden_states:  # (aux_hidden_state_layers is final once loaded)
            self.target_states = TargetStates(target_model, self.proposer.aux_hidden_state_layers)

    @property
    def reads_layer_states(self) -> bool:
        """Whether the proposer reads states inside the target (EAGLE-3): every forward must run the target's
        layers as modules (no fused C decode step, no CUDA graph), so that their hooks see them."""
        return bool(self.target_states is not None and self.target_states.layers)

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: nothing of it is kept (a draft's KV blocks are freed)."""
        self._draft_probs.pop(request_id, None)
        if self.target_states is not None:
            self.target_states.forget(request_id)
        self.proposer.remove([request_id])

    def take_states(self, hidden_states: torch.Tensor, scheduled: Mapping[str, int]) -> None:
        """After every forward: the target's states, for a proposer that reads them (target_states.py)."""
        if self.target_states is not None:
            self.target_states.take(hidden_states, scheduled)

    # -- the proposer's own KV cache (a draft's, a head's) --------------------------------------------------

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.proposer.kv_cache_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int) -> StartupRecord | None:
        """The proposer's own KV cache, as many blocks as the target's; its start-up record (None: it has none)."""
        if not self.proposer.kv_cache_bytes_per_block(self.block_size):
            return None
        started = time.time()
        self.proposer.initialize_kv_cache(num_blocks)
        return StartupRecord(pid=os.getpid(), role=current_process_role(), phase="kv cache",
                             plugin=PROPOSER_KV_CACHE, reason=self.proposer.describe() or "",
                             start=started, duration=time.time() - started)

    # -- verification --------------------------------------------------------------------------------------

    def verify(self, logits: torch.Tensor, request_ids: Sequence[str], drafts: Sequence[list[int]],
               states: Mapping[str, RequestHistory], sampler: Sampler) -> Verified:
        """`logits` `[sum(k_i + 1), vocab]`: request i's positions in order (grammar masks already applied);
        `drafts[i]` its drafts (k_i of them, maybe none)."""
        rows: list[SamplingRow] = []
        positions: list[SamplingRow] = []
        for request_id, own in zip(request_ids, drafts):
            state = states[request_id]
            row = SamplingRow(state.sampling, state.prompt_token_ids, state.output_token_ids, state.logit_controls)
            rows.append(row)
            positions.append(row)
            positions.extend(SamplingRow(state.sampling, state.prompt_token_ids,
                                         state.output_token_ids + own[:j], state.logit_controls)
                             for j in range(1, len(own) + 1))
        processed, raw_logprobs = sampler.before_temperature(logits, positions)
        counts = [len(own) for own in drafts]
        target = target_distributions(processed, rows, counts)
        width = max(counts)
        padded = torch.zeros((len(drafts), width), dtype=torch.long)
        for index, own in enumerate(drafts):
            padded[index, :len(own)] = torch.tensor(own, dtype=torch.long)
        draft_probs = None
        if self.proposer.has_draft_probs and any(counts):
            draft_probs = torch.cat([self._draft_probs.pop(rid)[:n] for rid, n in zip(request_ids, counts) if n])
        out = rejection_sample(padded, counts, target, [row.options.is_greedy for row in rows],
                               draft_probs=draft_probs, generators=request_generators(rows, logits.device),
                               generator=sampler.generator)
        emitted = [row[:n] for row, n in zip(out.token_ids.tolist(), out.num_emitted)]
        return Verified(emitted, self._logprobs(raw_logprobs, emitted, counts, positions))

    def verify_step(self, logits: torch.Tensor, request_ids: list[str], drafts: Sequence[list[int]],
                    states: Mapping[str, RequestHistory], sampler: Sampler, output: ModelRunnerOutput) -> None:
        """A step with drafts, in the worker: verified (`verify`), each request's emitted tokens appended to its
        history, and `output` filled: its last token as the sampled one, the accepted drafts before it, their
        logprobs, and the drafts proposed for the next step."""
        verified = self.verify(logits, request_ids, drafts, states, sampler)
        for request_id, tokens in zip(request_ids, verified.token_ids):
            state = states[request_id]
            state.token_ids.extend(tokens)
            state.output_token_ids.extend(tokens)
        output.request_ids = request_ids
        output.sampled_token_ids = [tokens[-1] for tokens in verified.token_ids]
        if verified.logprobs is not None:
            output.logprobs = [entries[-1] for entries in verified.logprobs]
            output.accepted_logprobs = [entries[:-1] for entries in verified.logprobs]
        accepted = [tokens[:-1] for tokens in verified.token_ids]
        # Of each verifying request's k + 1 target states, those of its kept positions are true.
        num_kept = [len(kept) + 1 if own else None for kept, own in zip(accepted, drafts)]
        self.propose_into(output, states, accepted, num_kept)

    def propose_into(self, output: ModelRunnerOutput, states: Mapping[str, RequestHistory],
                     accepted: list[list[int]] | None = None,
                     num_kept: Sequence[int | None] | None = None) -> None:
        """`output`'s speculative fields after a step that sampled `output.request_ids`: the drafts each
        accepted (none: a step without drafts), and the drafts proposed for its next step."""
        output.accepted_token_ids = accepted if accepted is not None else [[] for _ in output.request_ids]
        output.draft_token_ids = self.propose(output.request_ids, states, num_kept)

    @staticmethod
    def _logprobs(raw_logprobs: torch.Tensor | None, emitted: list[list[int]], counts: list[int],
                  positions: list[SamplingRow]) -> list[list[Logprobs]] | None:
        """Each emitted token's logprobs from the raw logits of the position it was emitted at."""
        if raw_logprobs is None:
            return None
        starts = np.cumsum([0] + [n + 1 for n in counts])[:-1].tolist()
        indices = [start + j for start, tokens in zip(starts, emitted) for j in range(len(tokens))]
        flat = torch.tensor([token for tokens in emitted for token in tokens], dtype=torch.long,
                            device=raw_logprobs.device)
        entries = Sampler.logprobs(raw_logprobs[indices], flat, [positions[i] for i in indices]) or []
        result: list[list[Logprobs]] = []
        offset = 0
        for tokens in emitted:
            result.append(list(entries[offset:offset + len(tokens)]))
            offset += len(tokens)
        return result

    # -- proposals -----------------------------------------------------------------------------------------

    def propose(self, request_ids: list[str], states: Mapping[str, RequestHistory],
                num_kept: Sequence[int | None] | None = None) -> list[list[int]]:
        """Drafts for each of `request_ids` (those that sampled this step), over their histories now;
        `num_kept`: of each one's target states this step, how many are true (None: all)."""
        if not request_ids:
            return []
        lengths = np.array([len(states[rid].token_ids) for rid in request_ids], dtype=np.int64)
        history = np.zeros((len(request_ids), int(lengths.max())), dtype=np.int64)
        for row, request_id in enumerate(request_ids):
            history[row, :lengths[row]] = states[request_id].token_ids
        batch = ProposalBatch(token_ids=history, num_tokens=lengths, request_ids=list(request_ids))
        if self.target_states is not None:
            batch.hidden_states, batch.num_hidden_states = self.target_states.rows(request_ids, num_kept)
        drafts = self.proposer.propose(batch, self.num_speculative_tokens)
        self.num_propose_calls += 1
        proposed = drafts.as_lists()
        if len(proposed) != len(request_ids) or any(len(own) > self.num_speculative_tokens for own in proposed):
            raise RuntimeError(f"proposer {type(self.proposer).__qualname__} (method {self.config.method}) returned "
                               f"{[len(own) for own in proposed]} drafts for {len(request_ids)} requests; propose must "
                               f"return one row per request of at most {self.num_speculative_tokens} drafts")
        self.num_proposed_tokens += sum(len(own) for own in proposed)
        if self.proposer.has_draft_probs and drafts.probs is not None:
            for row, request_id in enumerate(request_ids):
                self._draft_probs[request_id] = drafts.probs[row]
        return proposed


@reads("proposers", "worker")
def proposer_for(method: str) -> tuple[type[Proposer], str]:
    """The proposer class `method` names, and who registered it."""
    proposer_class = ProposerRegistry.proposer_class(method)
    entry = ProposerRegistry.get(method)
    return proposer_class, entry.owner if entry is not None else "?"


def proposer_context(config: Any, vocab_size: int, max_model_len: int, device: torch.device, *, dtype: torch.dtype,
                     block_size: int, platform: Any) -> ProposerContext:
    """What a proposer is told when built (ProposerContext), from the engine's config: a draft or head takes
    the target's dtype, block size and attention platform, the draft's quantization from speculative_config,
    and its KV cache is sized by the engine beside the target's (`initialize_kv_cache`)."""
    speculative = config.speculative
    return ProposerContext(vocab_size=vocab_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                           device=str(device), tensor_parallel_size=config.tensor_parallel_size,
                           dtype=str(dtype).removeprefix("torch."), block_size=block_size, platform=platform,
                           draft_quantization=speculative.quantization if speculative is not None else None,
                           kv_cache_sized_by_engine=True)
