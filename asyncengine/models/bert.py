"""BERT-family encoders (BertModel, XLM-RoBERTa) and their cross-encoder classifiers, for pooling.

An encoder attends both ways inside each sequence and keeps no KV cache: the step's pooling requests arrive
whole (the scheduler never chunks them), as one flat run of tokens; attention pads them to the longest
sequence of the step (a key mask hides the padding), while the embeddings, projections and MLPs run on the
flat tokens with no padding at all. Positions are absolute (XLM-RoBERTa's start after its padding index),
and `token_type_ids` (BERT's segment ids; zeros unless a cross-encoder's pair says otherwise) come from the
model runner. Checkpoint names follow transformers (`embeddings.`, `encoder.layer.N.`, `pooler.dense`; with
a `bert.` or `roberta.` prefix under a classifier), so the modules here carry the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.pooler import Pooler
from asyncengine.models.layers.attention import AttentionMetadata
from asyncengine import parallel_state as parallel

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": functional.gelu, "relu": functional.relu,
                "gelu_new": lambda x: functional.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: functional.gelu(x, approximate="tanh")}


class _Batch:
    """Where each sequence's tokens sit, flat and padded to the step's longest sequence."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        self.num_seqs = len(lengths)
        self.max_len = max(lengths)
        self.uniform = all(n == self.max_len for n in lengths)
        if not self.uniform:
            lens = torch.tensor(lengths, device=device)
            slot = torch.arange(self.max_len, device=device)
            valid = slot.unsqueeze(0) < lens.unsqueeze(1)  # [seqs, max_len]
            starts = torch.cumsum(lens, 0) - lens
            total = sum(lengths)
            # Padded slot -> flat row (padding reads an extra zero row at index `total`).
            self.gather = torch.where(valid, starts.unsqueeze(1) + slot, torch.full_like(valid, total, dtype=torch.int64)
                                      ).flatten()
            self.scatter = valid.flatten().nonzero().squeeze(1)  # padded slots that hold real tokens
            self.mask = valid[:, None, None, :]  # attend to real keys only


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.query = nn.Linear(hidden, hidden, dtype=dtype)
        self.key = nn.Linear(hidden, hidden, dtype=dtype)
        self.value = nn.Linear(hidden, hidden, dtype=dtype)
        self._fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def _qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        # One matrix for the three projections, built on first use (after the weights are in).
        if self._fused is None:
            self._fused = (torch.cat([self.query.weight, self.key.weight, self.value.weight]).detach(),
                           torch.cat([self.query.bias, self.key.bias, self.value.bias]).detach())
        return functional.linear(hidden, *self._fused)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        total, size = hidden.shape
        qkv = self._qkv(hidden)
        if batch.uniform:
            padded = qkv.view(batch.num_seqs, batch.max_len, 3, self.num_heads, self.head_dim)
            mask = None
        else:
            padded = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])])[batch.gather]
            padded = padded.view(batch.num_seqs, batch.max_len, 3, self.num_heads, self.head_dim)
            mask = batch.mask
        query, key, value = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [seqs, heads, max_len, head_dim]
        out = functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_len, size)
        return out if batch.uniform else out[batch.scatter]


class BertLayerOutput(nn.Module):
    """A dense projection, then LayerNorm over it plus the residual (BertSelfOutput and BertOutput)."""

    def __init__(self, in_size: int, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        setattr(self, "self", BertSelfAttention(config, dtype))  # transformers' name: attention.self.query
        self.output = BertLayerOutput(config.hidden_size, config, dtype)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        return self.output(getattr(self, "self")(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(config, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = BertLayerOutput(config.intermediate_size, config, dtype)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        attended = self.attention(hidden, batch)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, position_offset: int) -> None:
        super().__init__()
        self.position_offset = position_offset  # XLM-RoBERTa's positions start after its padding index
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(1, getattr(config, "type_vocab_size", 2)), config.hidden_size,
                                                  dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class BertPoolerDense(nn.Module):
    """transformers' BertPooler: the first token through a dense layer and tanh (kept for the classifiers)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_tokens))


def _first_rows(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    lens = torch.tensor(lengths, dtype=torch.int64, device=hidden.device)
    return hidden[torch.cumsum(lens, 0) - lens]


class BertModel(nn.Module):
    """The encoder; its output is every token's final hidden state (a pooler makes the embedding)."""

    is_pooling_model = True
    position_offset = 0

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int, add_pooler: bool = True) -> None:
        super().__init__()
        if parallel.world_size() > 1:
            raise ModelLoadError(f"{type(self).__name__} runs on one worker: tensor_parallel_size must be 1")
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype, self.position_offset_of(config))
        self.encoder = BertEncoder(config, dtype)
        self.pooler_dense = BertPoolerDense(config, dtype) if add_pooler else None

    @staticmethod
    def position_offset_of(config: Any) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if list(metadata.query_lens) != list(metadata.seq_lens):
            raise RuntimeError(f"{type(self).__name__} is an encoder: each sequence must arrive whole in one step "
                               "(the scheduler never chunks pooling requests)")
        batch = _Batch(list(metadata.query_lens), input_ids.device)
        if token_type_ids is None:  # the model runner's, for a cross-encoder's pair (pooling/step.py)
            token_type_ids = getattr(metadata, "token_type_ids", None)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no language-model head to sample from")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> None:
        _load_by_name(self, weights, prefix=prefix, renames={"pooler.dense.": "pooler_dense.dense."},
                      optional=("pooler_dense.",))


class XLMRobertaModel(BertModel):
    @staticmethod
    def position_offset_of(config: Any) -> int:
        return int(getattr(config, "pad_token_id", 1)) + 1


class BertClassifierHead(Pooler):
    """BertForSequenceClassification's head: [CLS] through the BERT pooler (dense, tanh), then the classifier."""

    def __init__(self, pooler_dense: BertPoolerDense, classifier: nn.Linear) -> None:
        super().__init__()
        self.pooler_dense = pooler_dense
        self.classifier = classifier

    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        return list(self.classifier(self.pooler_dense(_first_rows(hidden_states, lengths))).unbind(0))


class RobertaClassifierHead(Pooler):
    """RobertaClassificationHead: the first token through dense, tanh, then out_proj."""

    def __init__(self, module: "_RobertaClassifier") -> None:
        super().__init__()
        self.module = module

    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        first = _first_rows(hidden_states, lengths)
        return list(self.module.out_proj(torch.tanh(self.module.dense(first))).unbind(0))


def _num_labels(config: Any) -> int:
    labels = getattr(config, "id2label", None)
    return len(labels) if isinstance(labels, dict) and labels else int(getattr(config, "num_labels", 2) or 2)


class BertForSequenceClassification(nn.Module):
    """A cross-encoder (reranker) or classifier: class scores from the [CLS] token (the pooler: `self.pooler`)."""

    is_pooling_model = True
    encoder_cls: type[BertModel] = BertModel
    prefix = "bert."

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.bert = self.encoder_cls(config, dtype=dtype, max_position=max_position)
        self.classifier = nn.Linear(config.hidden_size, _num_labels(config), dtype=dtype)
        pooler_dense = self.bert.pooler_dense
        if pooler_dense is None:
            raise ModelLoadError("BertForSequenceClassification needs the BERT pooler layer")
        self.pooler = BertClassifierHead(pooler_dense, self.classifier)  # not a module: its layers are above

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, metadata, token_type_ids)

    compute_logits = BertModel.compute_logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        _load_by_name(self, weights, prefix="", renames={f"{self.prefix}pooler.dense.": "bert.pooler_dense.dense.",
                                                         self.prefix: "bert."})


class _RobertaClassifier(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.out_proj = nn.Linear(config.hidden_size, _num_labels(config), dtype=dtype)


class XLMRobertaForSequenceClassification(nn.Module):
    is_pooling_model = True

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.roberta = XLMRobertaModel(config, dtype=dtype, max_position=max_position, add_pooler=False)
        self.classifier = _RobertaClassifier(config, dtype)
        self.pooler = RobertaClassifierHead(self.classifier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.roberta(input_ids, positions, metadata, token_type_ids)

    compute_logits = BertModel.compute_logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        _load_by_name(self, weights, prefix="", renames={})


# Checkpoint tensors no model here needs (position_ids buffers, and the pooler of a checkpoint saved with one).
_IGNORED_SUFFIXES = ("position_ids", "token_type_ids")


def _load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, prefix: str,
                  renames: dict[str, str], optional: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into the parameters of the same name (after `renames`, first match); every
    parameter must be set, except those under `optional` prefixes."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        target = prefix + name
        for old, new in renames.items():
            if target.startswith(old):
                target = new + target[len(old):]
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but "
                                 f"{type(model).__name__}.{target} is {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(target)
    if unexpected:
        raise ModelLoadError(f"the checkpoint has tensors this {type(model).__name__} does not have: "
                             f"{', '.join(sorted(unexpected)[:8])}; is config.json's architecture right?")
    missing = sorted(n for n in params if n not in loaded and not n.startswith(optional))
    if missing:
        raise ModelLoadError(f"the checkpoint lacks weights for: {', '.join(missing[:8])}")
