"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): Llama's layer with
- attention: biases on q, k, v and o; a learned sink logit per head (`self_attn.sinks`) that joins each row's
  softmax and attends to nothing (PagedAttention's `sinks`: the TORCH_PAGED backend, C kernel or torch); sliding-window
  layers alternating with full ones (`layer_types`); yarn rope;
- norms applying their weight in float32 before the rounding (OLMo 2's kind);
- a mixture of `num_local_experts` experts with biases, routed by the top-k of the router's logits (the router
  has a bias) then a softmax over those k, and the clamped swiglu (`swiglu_limit`, alpha 1.702):
  `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=limit)`.

Checkpoint layout (transformers'): `mlp.router.{weight,bias}`; `mlp.experts.gate_up_proj` `[E, H, 2I]` with gate and
up interleaved along 2I (even columns gate, odd up) and its bias `[E, 2I]` the same; `mlp.experts.down_proj`
`[E, I, H]` and its bias `[E, H]`. They are converted on load to FusedMoE's `[E, 2I, H]` (gate rows, then up)
and `[E, H, I]`. The released checkpoints store the expert matrices as MXFP4 (`*_blocks`: two 4-bit E2M1 values
per byte, 32 values per block; `*_scales`: one power-of-two exponent per block, biased by 127): here they are
dequantized on load, on CPU, to the model dtype (bfloat16 or float32: four times the bytes of MXFP4; no MXFP4
kernel runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.linear import check_shape, copy_checked
from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncengine.models.moe import SparseMoeBlock, num_experts
from asyncengine.models.olmo2 import olmo2_norm

# The 16 values of a 4-bit E2M1 code (sign bit 3): MXFP4's elements.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks` uint8 `[..., G, 16]` (32 E2M1 values per block, the low nibble first) and `scales` uint8
    `[..., G]` (each block's exponent + 127) -> `[..., G * 32]` in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                             f"{scales.dtype} do not fit: expected uint8 [..., G, 16] and uint8 [..., G]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: each byte's low value first
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


class GptOssAttention(LlamaAttention):
    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__(config, dtype=dtype, layer_index=layer_index)
        # This rank's heads' sinks, float32 as transformers keeps them in the softmax.
        self.total_heads = int(config.num_attention_heads)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        object.__setattr__(self.attn, "sinks", self.sinks)  # handed to the backend, owned here

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, name: str) -> None:
        """`self_attn.sinks` `[num_attention_heads]`: this rank's heads."""
        check_shape(loaded, (self.total_heads,), name)
        first_head = self.q_rows[0] // self.head_dim
        copy_checked(param.data, loaded.narrow(0, first_head, self.num_heads), name)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention
    make_norm = staticmethod(olmo2_norm)

    @staticmethod
    def make_mlp(config: Any, dtype: torch.dtype, layer_index: int) -> nn.Module:
        options = dict(routing="topk_softmax", activation="swigluoai", has_bias=True,
                       swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                       swiglu_limit=float(config.swiglu_limit))
        return SparseMoeBlock(config, dtype=dtype, num_experts=num_experts(config),
                              intermediate_size=int(config.intermediate_size), renormalize=False, router_bias=True,
                              experts_options=options)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Router renamed to the MoE block's `gate`; expert tensors to FusedMoE's layout; MXFP4 pairs dequantized
        (a `_blocks` tensor waits for its `_scales`, or the reverse: checkpoints store them side by side)."""
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            for suffix in ("_blocks", "_scales"):
                if name.endswith(suffix) and ".mlp.experts." in name:
                    base = name.removesuffix(suffix)
                    pair = waiting.setdefault(base, {})
                    pair[suffix] = tensor
                    if len(pair) == 2:
                        del waiting[base]
                        yield from self._expert_tensor(base, self._dequantized(base, pair))
                    break
            else:
                yield from self._expert_tensor(name, tensor)
        if waiting:
            raise ModelLoadError(f"the checkpoint has MXFP4 blocks or scales without their pair: {', '.join(waiting)}")

    def _dequantized(self, base: str, pair: dict[str, torch.Tensor]) -> torch.Tensor:
        """An MXFP4 expert matrix as transformers' unquantized layout (`gate_up_proj` `[E, H, 2I]`, `down_proj`
        `[E, I, H]`): the blocks run along the input dimension, so the dequantized rows are transposed."""
        blocks, scales = pair["_blocks"], pair["_scales"]
        dequantized = dequantize_mxfp4(blocks.reshape(*scales.shape, -1), scales, self.model.dtype)
        return dequantized.transpose(1, 2).contiguous()

    @staticmethod
    def _expert_tensor(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows first
            rows = tensor.transpose(1, 2)
            tensor = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        elif name.endswith(".mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
            tensor = tensor.transpose(1, 2)
        yield name, tensor

