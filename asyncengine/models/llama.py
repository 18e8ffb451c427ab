"""Llama, and the decoder every native architecture here is built from (Qwen2, Qwen3, Mistral, Gemma 2 and 3,
Phi-3, OLMo 2, Granite, GLM-4, and the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE subclass this
file's classes and set its switches).

Written against the paged KV cache: the batch is a flat run of tokens with their positions, and each
attention layer reads keys and values from cache pages (asyncengine/models/layers/attention.py).
Checkpoint names follow transformers; q/k/v and gate/up are fused into one matrix each on load. The layers are
vLLM's (models/layers/linear.py, embedding.py: QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding, ParallelLMHead) and `load_weights` is vLLM's loop: a stacked-params mapping sends
q/k/v and gate/up to their fused parameter with a shard id, and each parameter's `weight_loader` takes its
rank's part. With tensor parallelism each rank holds whole KV-head groups (`partition_heads`), a slice of the
MLP and of the vocabulary.
With pipeline parallelism each stage holds its range of decoder layers (the embedding on the first, the
final norm and the head on the last; `PPMissingLayer` keeps the others' places, so checkpoint names stay
as they are), receives the previous stage's hidden states and residual and sends its own on.

What the architectures change is said by class attributes and hooks, each read once while building:
- attention (`LlamaAttention`): the q/k/v and o biases, the scale of the scores, each layer's sliding window and
  the soft cap of its scores, its rope parameters (per layer type: Gemma 3's local and global bases), a norm of
  the query and key heads before rotary (`normalize_qk`: Qwen3, Gemma 3, OLMo 2);
- the layer (`LlamaDecoderLayer`): which norms sit around attention and the MLP (`norm_names`: before each
  block, on each block's output, or both), the norm's kind (`make_norm`), the MLP (`make_mlp`: a mixture of
  experts, asyncengine/models/moe.py) and its activation, a multiplier on each block's output before it joins
  the residual (Granite);
- the model and the head: a scale on the embeddings (Gemma's sqrt(hidden_size), Granite's multiplier), a
  divisor and a soft cap on the logits (Granite, Gemma 2).
Checkpoints that store q/k/v or gate/up fused (Phi-3, GLM-4) load into the same fused layers (`load_weights`);
expert tensors go to their FusedMoE layer; a checkpoint named or laid out otherwise is converted first
(`checkpoint_weights`: Mixtral's `block_sparse_moe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.activation import gated_activation
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncengine.models.layers.fused_moe import FusedMoE
from asyncengine.models.layers.logits import finish_logits, some_names
from asyncengine.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncengine.models.layers.linear import copy_checked
from asyncengine.models.layers.norm import RMSNorm
from asyncengine.models.layers.rotary import RotaryEmbedding, rope_parameters
from asyncengine import parallel_state as parallel

# Checkpoint tensors that older exports carry but no model needs.
IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)


CosSin = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type(config: Any, layer_index: int) -> str | None:
    """transformers' `layer_types[i]` ("full_attention", "sliding_attention"), None for a config without them."""
    types = getattr(config, "layer_types", None)
    return types[layer_index] if types and layer_index < len(types) else None


class LlamaAttention(nn.Module):
    rotary_emb: RotaryEmbedding  # the model's rotary op for this layer's rope key, set by LlamaModel

    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0, prefix: str | None = None) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_index}.self_attn" if prefix is None else prefix
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, dim, total_heads, total_kv_heads,
                                          bias=self.qkv_bias(config), params_dtype=dtype, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # This rank's rows of the q and of the k/v projections (whole KV-head groups: partition_heads).
        self.q_rows, self.kv_rows = self.qkv_proj.q_range, self.qkv_proj.kv_range
        self.q_size, self.kv_size = self.num_heads * dim, self.num_kv_heads * dim
        self.o_proj = RowParallelLinear(total_heads * dim, config.hidden_size, bias=self.o_bias(config),
                                        params_dtype=dtype, input_partition=self.q_rows, prefix=f"{prefix}.o_proj")
        self.rope_key = self.rope_parameters_key(config, layer_index)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.attention_scale(config),
                                   sliding_window=self.sliding_window(config, layer_index),
                                   logits_soft_cap=self.logits_soft_cap(config), layer_index=layer_index)

    @staticmethod
    def qkv_bias(config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_bias(config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def attention_scale(self, config: Any) -> float:
        """The factor on q.k (Gemma: query_pre_attn_scalar ** -0.5; Granite: attention_multiplier)."""
        return self.head_dim**-0.5

    @staticmethod
    def sliding_window(config: Any, layer_index: int) -> int | None:
        """This layer's window: `sliding_window` on the layers `layer_types` calls sliding (Gemma 2/3, and Qwen2/3
        with use_sliding_window); Mistral and Phi-3 put it on every layer."""
        window = getattr(config, "sliding_window", None)
        return int(window) if window is not None and layer_type(config, layer_index) == "sliding_attention" else None

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        """`cap` in `cap * tanh(score / cap)` on the attention scores (Gemma 2's attn_logit_softcapping)."""
        return None

    @staticmethod
    def rope_parameters_key(config: Any, layer_index: int) -> str | None:
        """Which of the config's rope parameters this layer uses: its layer type where `rope_parameters` is
        given per type (Gemma 3: a local base for sliding layers, a global one for full layers), else None."""
        params = getattr(config, "rope_parameters", None)
        kind = layer_type(config, layer_index)
        return kind if isinstance(params, dict) and isinstance(params.get(kind), dict) else None

    def normalize_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for architectures that normalize heads before rotary (Qwen3); Llama does not."""
        return query, key

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv, _ = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = self.normalize_qk(query, key)
        query, key = self.rotary_emb(query, key, cos_sin)
        output, _ = self.o_proj(self.attn(query, key, value.contiguous(), metadata))
        return output


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype, intermediate_size: int | None = None,
                 prefix: str = "") -> None:
        """`intermediate_size`: the config's unless given (a MoE model's dense layers and shared expert)."""
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias, params_dtype=dtype,
                                                       prefix=f"{prefix}.gate_up_proj" if prefix else "")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, params_dtype=dtype,
                                           prefix=f"{prefix}.down_proj" if prefix else "")
        # `act(gate) * up`: SiLU, or Gemma's GELU (`hidden_activation`, else `hidden_act`).
        self.act = gated_activation(str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
                                        or "silu"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(hidden)
        output, _ = self.down_proj(self.act(gate_up))
        return output


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # The norms around the two blocks, by their checkpoint names: (before attention, on attention's output,
    # before the MLP, on the MLP's output); None where the architecture has none. Llama normalizes each
    # block's input; Gemma 2/3 and GLM-4 also its output (sandwich); OLMo 2 only the outputs.
    norm_names: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm", None, "post_attention_layernorm", None)

    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, dtype=dtype, layer_index=layer_index)
        self.mlp = self.make_mlp(config, dtype, layer_index)
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, self.make_norm(config, config.hidden_size, dtype))
        self._norms = tuple(None if name is None else getattr(self, name) for name in self.norm_names)
        self.residual_multiplier = self.block_output_multiplier(config)

    @staticmethod
    def make_mlp(config: Any, dtype: torch.dtype, layer_index: int) -> nn.Module:
        """The block after attention, `[tokens, hidden] -> [tokens, hidden]`: Llama's gated MLP (a mixture of
        experts on a MoE architecture's sparse layers, asyncengine/models/moe.py)."""
        return LlamaMLP(config, dtype=dtype, prefix=f"model.layers.{layer_index}.mlp")

    @staticmethod
    def make_norm(config: Any, size: int, dtype: torch.dtype) -> nn.Module:
        """The architecture's norm (the model's final norm is one too): Llama's RMSNorm."""
        return RMSNorm(size, config.rms_norm_eps, dtype=dtype)

    @staticmethod
    def block_output_multiplier(config: Any) -> float | None:
        """A factor on each block's output before it joins the residual (Granite's residual_multiplier)."""
        return None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` + `residual` is the residual stream (`residual` None: `hidden` alone, at the first layer):
        the addition is left to the next norm, which fuses it. Returns the stream the same way."""
        before_attention, after_attention, before_mlp, after_mlp = self._norms
        if before_attention is None:  # no norm to fuse the addition into: the stream is attention's input
            hidden = residual = hidden if residual is None else hidden + residual
        elif residual is None:
            residual = hidden
            hidden = before_attention(hidden)
        else:
            hidden, residual = before_attention(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, metadata)
        if after_attention is not None:
            hidden = after_attention(hidden)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        if before_mlp is None:
            hidden = residual = hidden + residual
        else:
            hidden, residual = before_mlp(hidden, residual)
        hidden = self.mlp(hidden)
        if after_mlp is not None:
            hidden = after_mlp(hidden)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class PPMissingLayer(nn.Identity):
    """The place of a layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    rotary_cls: type[RotaryEmbedding] = RotaryEmbedding  # M-RoPE's for the Qwen-VL family (layers/mrope.py)

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        first, last = parallel.is_first_stage(), parallel.is_last_stage()
        self.start_layer, self.end_layer = parallel.stage_layers(config.num_hidden_layers)
        self.embed_tokens: nn.Module = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=dtype,
                                                               prefix="model.embed_tokens")
                                        if first else PPMissingLayer())
        self.embed_scale = self.embedding_scale(config, dtype)
        # One rotary table per rope key (one, unless the layer types have their own parameters, as Gemma 3's);
        # their cos/sin are looked up once per step and passed to the layers.
        self.rotaries: dict[str | None, RotaryEmbedding] = {}
        self.rope_keys: list[str | None] = []  # of this stage's layers, in order
        layers: list[nn.Module] = []
        for index in range(config.num_hidden_layers):
            if not self.start_layer <= index < self.end_layer:
                layers.append(PPMissingLayer())
                continue
            layer = self.layer_cls(config, dtype=dtype, layer_index=index)
            key = layer.self_attn.rope_key
            if key not in self.rotaries:
                self.rotaries[key] = self.rotary_cls(head_dim_of(config), max_position, self.rope_parameters(config, key))
            # Shared, not copied: one table, and one op a plugin may replace (CustomOp "RotaryEmbedding").
            layer.self_attn.rotary_emb = self.rotaries[key]
            self.rope_keys.append(key)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm: nn.Module = (self.layer_cls.make_norm(config, config.hidden_size, dtype) if last
                                else PPMissingLayer())

    @staticmethod
    def embedding_scale(config: Any, dtype: torch.dtype) -> float | torch.Tensor | None:
        """A factor on the embeddings (Gemma: sqrt(hidden_size) in the model's dtype; Granite's multiplier)."""
        return None

    @staticmethod
    def rope_parameters(config: Any, key: str | None) -> dict[str, Any]:
        """The rope parameters of rope key `key` (LlamaAttention.rope_parameters_key)."""
        return rope_parameters(config, key)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer reads (scaled where the architecture scales them)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale if self.embed_scale is not None else hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the first layer's input as `embed_input_ids` makes it, with a multimodal model's
        embeddings merged in (asyncengine/interfaces/multimodal.py); None: from `input_ids`."""
        if parallel.is_first_stage():
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:  # the previous stage's hidden states and residual, one row per token of this step
            shape = (input_ids.shape[0], self.hidden_size)
            hidden, residual = parallel.receive_from_previous_stage([shape, shape], self.dtype, input_ids.device)
        cos_sins = {key: rotary.lookup(positions, hidden.dtype) for key, rotary in self.rotaries.items()}
        for layer, key in zip(self.layers[self.start_layer:self.end_layer], self.rope_keys):
            hidden, residual = layer(hidden, residual, cos_sins[key], metadata)
        if not parallel.is_last_stage():
            sent_residual = residual if residual is not None else hidden  # (every stage holds a layer)
            parallel.send_to_next_stage([hidden, sent_residual])
            return hidden  # not final: the last stage computes the logits
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, dtype=dtype, max_position=max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        first, last = parallel.is_first_stage(), parallel.is_last_stage()
        self.lm_head: nn.Module = (ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype,
                                                  prefix="lm_head")
                                   if last else PPMissingLayer())
        # Tied on one stage; a last stage without the embedding loads its head from the embedding's tensor.
        self.shares_embedding = self.tie_word_embeddings and first and last
        self.head_from_embedding = self.tie_word_embeddings and last and not first
        if self.shares_embedding and isinstance(self.lm_head, ParallelLMHead) \
                and isinstance(self.model.embed_tokens, VocabParallelEmbedding):
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_divisor = self.logits_scaling(config)
        self.final_logit_soft_cap = self.final_logit_softcapping(config)

    @staticmethod
    def logits_scaling(config: Any) -> float | None:
        """A divisor on the logits (Granite's logits_scaling)."""
        return None

    @staticmethod
    def final_logit_softcapping(config: Any) -> float | None:
        """`cap` in `cap * tanh(logit / cap)` (Gemma 2's final_logit_softcapping)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states, one row per input token."""
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return finish_logits(self.lm_head(hidden), divisor=self.logits_divisor, cap=self.final_logit_soft_cap)

    # vLLM's: (fused parameter, checkpoint projection, shard id) for the checkpoint tensors a fused layer holds.
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (transformers names) into the parameters, each through its `weight_loader`
        (vLLM's loop); every parameter must be set. Returns the names of the parameters loaded, as vLLM's do."""
        params = dict(self.named_parameters())
        required = self._required_pieces(params)
        loaded: set[tuple[str, Any]] = set()
        unexpected: list[str] = []
        for name, tensor in self.checkpoint_weights(weights):
            if name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # a tied checkpoint may still store the copy
            if self.head_from_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            elif self._on_another_stage(name):
                continue
            experts = self._experts_of(name)
            if experts is not None:  # a MoE layer's expert tensor: the layer takes its experts' parts
                module_name, layer, key = experts
                pieces = layer.load_checkpoint(key, tensor, name)
                loaded.update((f"{module_name}.{leaf}", piece) for leaf, piece in pieces)
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                fused = name.replace(weight_name, param_name)
                if weight_name in name and fused in params:
                    param = params[fused]
                    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                    loaded.add((fused, shard_id))
                    break
            else:
                whole = params.get(name)
                if whole is None:
                    unexpected.append(name)
                    continue
                self._load_whole(name, whole, tensor)
                loaded.update(self._pieces_of(name))
        if unexpected:
            raise ModelLoadError(
                f"the checkpoint has tensors this {type(self).__name__} does not have: "
                f"{some_names(unexpected)}; is config.json's architecture right for these weights?"
            )
        missing = [name if shard is None else f"{name} (shard {shard})" for name, shard in required - loaded]
        if missing:
            raise ModelLoadError(f"the checkpoint lacks weights for: {some_names(missing)}")
        return {name for name, _ in required | loaded}  # every piece required was loaded (checked above)

    def _load_whole(self, name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
        """A checkpoint tensor with no shard id: through the parameter's weight_loader (a fused layer's, given
        the fused tensor: Phi-3's qkv_proj, GLM-4's gate_up_proj, splits it); a module's `load(param, tensor,
        shard, name)` where its parameter has none (GPT-OSS's sinks); else copied whole."""
        weight_loader = getattr(param, "weight_loader", None)
        if weight_loader is not None:
            weight_loader(param, tensor)
            return
        load = getattr(self.get_submodule(name.rsplit(".", 1)[0]), "load", None)
        if load is not None:
            load(param, tensor, None, name)
        else:
            copy_checked(param.data, tensor, name)

    def _pieces_of(self, name: str) -> list[tuple[str, Any]]:
        """The (parameter, shard id) pieces a whole tensor named `name` fills: every shard of a fused layer."""
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, ColumnParallelLinear) and module.num_shards > 1:
            return [(name, shard) for shard in module.shard_ids()]
        return [(name, None)]

    def _required_pieces(self, params: dict[str, nn.Parameter]) -> set[tuple[str, Any]]:
        """(parameter, shard id) pairs a checkpoint must provide; shard None for unfused parameters."""
        required: set[tuple[str, Any]] = set()
        for name in params:
            if self.shares_embedding and name == "lm_head.weight":
                continue
            module_name, leaf = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if leaf in getattr(getattr(module, "quant_method", None), "computed_parameters", ()):
                continue  # computed while loading (a quantization scale), not read from the checkpoint
            if isinstance(module, FusedMoE):  # each expert's gate, up and down, wherever the checkpoint has them
                required.update((name, piece) for piece in module.checkpoint_pieces(leaf))
                continue
            required.update(self._pieces_of(name))
        return required

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model names and lays them out: an architecture whose checkpoint
        differs (Mixtral's `block_sparse_moe`) renames or converts them here. Llama's are as they are."""
        return weights

    def _experts_of(self, name: str) -> tuple[str, FusedMoE, str] | None:
        """(module name, FusedMoE layer, the name's rest) for an expert tensor (`....mlp.experts.3.up_proj.weight`,
        `....mlp.experts.gate_up_proj`), None for any other tensor."""
        prefix, found, key = name.partition(".experts.")
        if not found:
            return None
        module_name = prefix + ".experts"
        try:
            layer = self.get_submodule(module_name)
        except AttributeError:
            return None
        return (module_name, layer, key) if isinstance(layer, FusedMoE) else None

    def _on_another_stage(self, name: str) -> bool:
        """A checkpoint tensor that another pipeline stage loads (never with a single stage)."""
        if parallel.pipeline_size() == 1:
            return False
        model = self.model
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return not model.start_layer <= index < model.end_layer
        if name.startswith("model.embed_tokens."):
            return not parallel.is_first_stage()
        if name.startswith(("model.norm.", "lm_head.")):
            return not parallel.is_last_stage()
        return False
