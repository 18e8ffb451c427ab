"""EAGLE and EAGLE-3 draft heads, in the layouts of their published checkpoints (as vLLM's llama_eagle.py and
llama_eagle3.py read them), built from the project's Llama layers and paged attention.

EAGLE (Li et al. 2024; checkpoints such as yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` maps the concatenation
[embedding of token t_{j+1}, the target's final hidden state at j] to one hidden state, then the head's
decoder layers run (the first without its input norm, as EAGLE's cnets.py removes it); the head's output,
hidden + residual with no final norm, goes through the target's lm_head, and is also the hidden state the next
draft step feeds back. Checkpoint names: `fc.weight` (`fc.bias` in EAGLE's first checkpoints), `layers.N.*`,
optionally `embed_tokens.weight` (otherwise, and as vLLM does, the target's embedding is used).

EAGLE-3 (Li et al. 2025; yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the speculators' exports): `fc` maps three target
layers' hidden states, concatenated (`target_hidden_size * 3` wide), to one; the single decoder layer
(`midlayer.*`) normalises the token's embedding (`input_layernorm`) and the hidden state (`hidden_norm`) and
attends over their concatenation (its q/k/v take 2 x hidden_size); the residual is the hidden state (or its
norm, with `norm_before_residual`); a final `norm` and the head's own `lm_head` over `draft_vocab_size` ids give
the logits, and `d2t` maps draft id i to target id `i + d2t[i]` (`t2d` is not needed to draft). The
pre-norm hidden state is what the next draft step feeds back (in place of fc's output).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.attention import AttentionMetadata
from asyncengine.models.layers.embedding import VocabParallelEmbedding
from asyncengine.models.layers.linear import QKVParallelLinear, ReplicatedLinear, copy_checked
from asyncengine.models.layers.logits import some_names
from asyncengine.models.layers.norm import RMSNorm
from asyncengine.models.layers.rotary import RotaryEmbedding, rope_parameters
from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, head_dim_of

# Checkpoint names from the speculators library's exports, as vLLM maps them.
_RENAMES = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}
_STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


class _FirstEagleLayer(LlamaDecoderLayer):
    """EAGLE's first layer: no norm before attention (fc's output goes in as it is)."""

    norm_names = (None, None, "post_attention_layernorm", None)


class _Head(nn.Module):
    """What both heads share: an optional own embedding, the rotary table, weight loading."""

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int, own_embedding: bool) -> None:
        super().__init__()
        self.config, self.hidden_size = config, int(config.hidden_size)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=dtype)
                             if own_embedding else None)
        self.rotary = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[tuple[str, Any]] = set()
        unexpected = []
        for checkpoint_name, tensor in weights:
            name = self.checkpoint_name(checkpoint_name)
            if name is None:
                continue
            for fused, part, shard in _STACKED:
                if part in name and name.replace(part, fused) in params:
                    param = params[name.replace(part, fused)]
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    loaded.add((name.replace(part, fused), shard))
                    break
            else:
                if name in buffers:
                    copy_checked(buffers[name], tensor.to(buffers[name].dtype), name)
                    loaded.add((name, None))
                elif name in params:
                    loader = getattr(params[name], "weight_loader", None)
                    if loader is not None:
                        loader(params[name], tensor)
                    else:
                        copy_checked(params[name].data, tensor, name)
                    loaded.add((name, None))
                else:
                    unexpected.append(name)
        if unexpected:
            raise ModelLoadError(f"the {type(self).__name__} checkpoint has tensors the head does not have: "
                                 f"{some_names(unexpected)}; is it an {type(self).__name__} checkpoint?")
        done = {name for name, _ in loaded}
        missing = [name for name in list(params) + list(self.required_buffers) if name not in done]
        if missing:
            raise ModelLoadError(f"the {type(self).__name__} checkpoint lacks {some_names(missing)}")

    required_buffers: tuple[str, ...] = ()

    def checkpoint_name(self, name: str) -> str | None:
        """The head's parameter for a checkpoint tensor's name (None: not needed)."""
        name = _RENAMES.get(name, name)
        return name.removeprefix("model.")

    def embed(self, input_ids: torch.Tensor, target_embedding: nn.Module) -> torch.Tensor:
        return (self.embed_tokens or target_embedding)(input_ids)


class EagleHead(_Head):
    """EAGLE's head (module docstring): `forward` returns (what the logits come from, the hidden state fed
    back), here the same tensor."""

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int, own_embedding: bool,
                 fc_bias: bool) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position, own_embedding=own_embedding)
        hidden = self.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias, params_dtype=dtype, return_bias=False)
        self.layers = nn.ModuleList([(_FirstEagleLayer if index == 0 else LlamaDecoderLayer)(
            config, dtype=dtype, layer_index=index) for index in range(int(config.num_hidden_layers))])
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary  # type: ignore[union-attr]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                metadata: AttentionMetadata, target_embedding: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.embed(input_ids, target_embedding)
        stream = self.fc(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1))
        cos_sin = self.rotary.lookup(positions, stream.dtype)
        residual = None
        for layer in self.layers:
            stream, residual = layer(stream, residual, cos_sin, metadata)
        out = stream + residual
        return out, out


class _Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (`midlayer`): attention over [norm(embedding), norm(hidden)]."""

    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, dtype=dtype, layer_index=0)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.head_dim, int(config.num_attention_heads),
                                          int(getattr(config, "num_key_value_heads", None)
                                              or config.num_attention_heads),
                                          bias=bool(getattr(config, "attention_bias", False)), params_dtype=dtype)
        self.mlp = LlamaMLP(config, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, cos_sin: Any,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attended = self.self_attn(torch.cat([self.input_layernorm(embedded), normed], dim=-1), cos_sin, metadata)
        stream, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(stream), residual


class Eagle3Head(_Head):
    """EAGLE-3's head (module docstring): `forward` returns (the normed hidden state the logits come from,
    the pre-norm one fed back); `draft_to_target(ids)` maps draft ids to the target's."""

    required_buffers: tuple[str, ...] = ("d2t",)

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int, own_embedding: bool,
                 target_hidden_size: int, has_d2t: bool) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position, own_embedding=own_embedding)
        if int(config.num_hidden_layers) != 1:
            raise ModelLoadError(f"this EAGLE-3 head has {config.num_hidden_layers} decoder layers; the published "
                                 "EAGLE-3 layout (and the one built here) has one (`midlayer`)")
        hidden = self.hidden_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = ReplicatedLinear(3 * target_hidden_size, hidden, bias=False, params_dtype=dtype, return_bias=False)
        self.midlayer = _Eagle3Layer(config, dtype=dtype)
        self.midlayer.self_attn.rotary_emb = self.rotary
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps), dtype=dtype)
        self.lm_head = ReplicatedLinear(hidden, self.draft_vocab_size, bias=False, params_dtype=dtype,
                                        return_bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        if not has_d2t:  # a head over the target's whole vocabulary: draft id i is target id i
            self.required_buffers = ()

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name) or name
        if name == "t2d":
            return None
        return "midlayer." + name.removeprefix("midlayer.").removeprefix("layers.0.") \
            if name.startswith(("midlayer.", "layers.0.")) else name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                metadata: AttentionMetadata, target_embedding: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.embed(input_ids, target_embedding)
        hidden = hidden.to(embedded.dtype)
        if hidden.shape[-1] != self.hidden_size:  # the target's layers, concatenated: fc combines them
            hidden = self.fc(hidden)
        stream, residual = self.midlayer(embedded, hidden, self.rotary.lookup(positions, embedded.dtype), metadata)
        normed, prenorm = self.norm(stream, residual)
        return normed, prenorm

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[rows, draft_vocab_size]`."""
        return self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t: torch.Tensor = self.d2t  # type: ignore[assignment]
        return draft_ids + d2t[draft_ids]


def weight_names(files: list[Path]) -> set[str]:
    """The tensor names of safetensors files, without reading the tensors."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


__all__ = ["Eagle3Head", "EagleHead", "weight_names"]
