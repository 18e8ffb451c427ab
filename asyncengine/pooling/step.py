"""The worker's side of pooling: after a step's forward pass, the pooling requests whose prompt it finished
get their pooled output instead of a sampled token (the model runner calls `PoolingStep.run`).

The pooler is the model's own when its class has one (a classifier's head: `model.pooler`), else the one the
pooler config names (PoolerRegistry). Per request, after the pooler: `dimensions` keeps the first values,
`normalize` L2-normalizes (task "embed"); `activation` applies softmax, or sigmoid for one label (tasks
"classify", "score"). Outputs travel as float32 bytes (PooledTensor).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from asyncengine.errors import ConfigError
from asyncengine.interfaces.pooler import Pooler, PoolerRegistry
from asyncengine.config.pooling import PoolerConfig
from asyncengine.pooling.params import TOKEN_TASKS
from asyncengine.wire.pooling import PooledTensor, PoolingOptions
from asyncengine.wire.startup import StartupRecord

if TYPE_CHECKING:
    from asyncengine.config.model import ModelConfig
    from asyncengine.config.engine import EngineConfig


class PoolingStep:
    def __init__(self, model: Any, pooler_config: PoolerConfig, hf_config: Any) -> None:
        self.config = pooler_config
        own = getattr(model, "pooler", None)
        if pooler_config.pooling_type is None:
            if not isinstance(own, Pooler):
                raise ConfigError(f"{type(model).__name__} is a classifier but has no pooler of its own (a Pooler as "
                                  "`model.pooler`): pass --pooler-config to choose one", field="pooler_config")
            self.pooler: Pooler = own
            self.name = f"{type(own).__name__} (the model's own head)"
        else:
            self.pooler = PoolerRegistry.pooler_class(pooler_config.pooling_type)(hf_config)
            self.name = f"{pooler_config.pooling_type} ({type(self.pooler).__module__}:{type(self.pooler).__qualname__})"

    def describe(self) -> str:
        """For the start-up report: the pooler and what chose it."""
        return f"{self.name}, chosen by {self.config.source}; normalize={self.config.normalize}"

    def run(self, hidden: torch.Tensor, spans: list[tuple[str, int, int]], states: dict[str, Any]) -> list[PooledTensor]:
        """`spans`: (request id, first row, end row) of each pooling request in `hidden`, in batch order;
        `states`: the model runner's requests by id (each pooling one has its `pooling` options)."""
        per_token = {span[0] for span in spans if states[span[0]].pooling.task in TOKEN_TASKS}
        pooled: dict[str, torch.Tensor] = {}
        sequence_spans = [span for span in spans if span[0] not in per_token]
        if sequence_spans:
            pooled.update(zip([rid for rid, _, _ in sequence_spans], self._pool(hidden, sequence_spans)))
        for request_id, start, end in spans:
            if request_id in per_token:
                pooled[request_id] = self._per_token(hidden[start:end], states[request_id].pooling.task)
        return [self._finish(pooled[request_id], states[request_id].pooling) for request_id, _, _ in spans]

    def _pool(self, hidden: torch.Tensor, spans: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        if len(spans) == 1 or all(spans[i][2] == spans[i + 1][1] for i in range(len(spans) - 1)):
            rows = hidden[spans[0][1]:spans[-1][2]]  # adjacent: one slice, no copy
        else:
            rows = torch.cat([hidden[start:end] for _, start, end in spans])
        return list(self.pooler.pool(rows, [end - start for _, start, end in spans]))

    def _per_token(self, rows: torch.Tensor, task: str) -> torch.Tensor:
        """token_embed: the tokens' hidden states; token_classify: the model's head at every token (each token
        pooled as a sequence of its own, so a classifier's head, or a plugin's pooler, scores each one)."""
        if task == "token_embed":
            return rows
        return torch.stack(self.pooler.pool(rows, [1] * rows.shape[0]))

    @staticmethod
    def _finish(value: torch.Tensor, options: PoolingOptions) -> PooledTensor:
        value = value.float()
        if options.task in ("embed", "token_embed"):  # per vector: the last dimension (each token's, per token)
            if options.dimensions is not None:
                value = value[..., : options.dimensions]
            if options.normalize:
                value = torch.nn.functional.normalize(value, p=2, dim=-1)
        elif options.task in ("classify", "score", "token_classify") and options.activation:
            value = torch.sigmoid(value) if value.shape[-1] == 1 else torch.softmax(value, dim=-1)
        array = value.detach().cpu().contiguous().numpy()
        return PooledTensor(array.astype("<f4").tobytes(), list(array.shape))


def build_pooling_step(model: Any, model_config: ModelConfig, records: list[StartupRecord],
                       role: str) -> PoolingStep | None:
    """The worker's PoolingStep for a model with a pooler config (None: this model pools nothing), its choice
    recorded for the start-up report (`records`, the model runner's, as this process's `role`)."""
    if model_config.pooler is None:
        return None
    started = time.time()
    step = PoolingStep(model, model_config.pooler, model_config.load_hf_config())
    records.append(StartupRecord(pid=os.getpid(), role=role, phase="load model", plugin="pooler",
                                 reason=step.describe(), start=started, duration=time.time() - started))
    return step


def encoder_num_blocks(engine_config: EngineConfig, model_config: ModelConfig) -> int:
    """KV "blocks" for a model without attention caches (an encoder): block ids the scheduler hands out and
    frees, with no memory behind them. Enough for the steps in flight (two with async scheduling) at the full
    token budget, and for one sequence of max_model_len."""
    block = engine_config.block_size
    per_step = -(-engine_config.effective_max_num_batched_tokens // block) + engine_config.max_num_seqs
    return max(2 * per_step, -(-model_config.max_model_len // block))


def set_token_type_ids(metadata: Any, spans: list[tuple[str, int, int]], states: dict[str, Any],
                       num_tokens: int, device: Any) -> None:
    """BERT's segment ids for this step, where a pooling request has any (a cross-encoder's pair): carried on
    the step's metadata as `token_type_ids` (`[num_tokens]`, zeros elsewhere), which BERT-family models read."""
    pairs = [(start, states[rid].pooling.token_type_ids) for rid, start, _ in spans
             if states[rid].pooling.token_type_ids]
    if not pairs:
        return
    values = torch.zeros(num_tokens, dtype=torch.int64)
    for start, ids in pairs:
        values[start:start + len(ids)] = torch.tensor(ids, dtype=torch.int64)
    metadata.token_type_ids = values.to(device)
