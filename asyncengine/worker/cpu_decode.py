"""The CPU's captured decode step: small decode batches of a Llama-shaped model (Qwen2, Qwen3) as one C call.

What CUDA graphs are to a GPU (worker/cuda_graphs.py), this is to a CPU: at one to `MAX_ROWS` decoding
sequences the step's cost is the layers' per-op overhead (Python, dispatch, a thread fork/join per op),
not their arithmetic; ops/cpu_decode_step.py runs the embedding, every decoder layer and the final norm in
one call, with one thread team for the whole step. Larger batches, prompts and mixed steps run the model's
modules as before (there the matmuls are real work, which oneDNN does best).

It applies only where it computes exactly what the model's modules would: it reads the weights from
the modules' attributes (nothing is copied or restructured) after checking that every module is the
built-in one running its built-in code: Llama's classes (or subclasses that change none of what the
step does; Qwen2's q/k/v biases and Qwen3's RMSNorm on each query and key head are the kernel's too),
RMSNorm (one eps throughout), SiLU-and-mul and the NeoX rotary over whole heads, each with `native` first
among its op's providers and no out-of-tree replacement; plain float weights or `quantization="gguf"`'s
packed blocks (the kernel runs the same block products: ops/cpu_decode_blocks.py), no other biases; the built-in
CPU attention backend with neither sliding window, soft cap nor sinks; one worker, no LoRA, no KV
connector, one KV cache group; float32 or bfloat16 with the C kernel built. Anything else keeps the
modules, with the reason logged once at start-up. `enforce_eager=True` turns it off, as it does CUDA graphs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from asyncengine.models.layers.attention import AttentionMetadata
from asyncengine.models.layers.logits import finish_logits
from asyncengine.ops import cpu_block_int8, cpu_decode_blocks, cpu_decode_step

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig

logger = logging.getLogger(__name__)

MAX_ROWS = cpu_decode_step.MAX_ROWS


class CpuDecodeStep:
    """Runs a decode step of up to `max_batch_size` sequences through ops/cpu_decode_step.py."""

    def __init__(self, model: Any, attention_layers: list[Any], max_batch_size: int) -> None:
        self.model = model
        self.attention_layers = attention_layers
        self.max_batch_size = max_batch_size
        self._weights: cpu_decode_step.DecoderWeights | None = None
        self._bound_cache: int | None = None  # data_ptr of the first layer's key cache the table points into
        self._nibbles: dict[int, tuple[Any, cpu_decode_blocks.BlockWeights]] = {}  # id(PackedBlocks): (it, its form)

    @classmethod
    def build(cls, model: Any, attention_layers: list[Any], dtype: torch.dtype,
              engine_config: EngineConfig) -> tuple[CpuDecodeStep | None, str]:
        """(the step, what it covers) or (None, why it does not apply)."""
        reason = why_not(model, attention_layers, dtype, engine_config)
        if reason is not None:
            return None, reason
        step = cls(model, attention_layers, min(MAX_ROWS, engine_config.max_num_seqs))
        return step, f"decode steps of 1-{step.max_batch_size} sequences as one C call (ops/cpu_decode_step.py)"

    def applies(self, metadata: AttentionMetadata) -> bool:
        return metadata.decode_only and len(metadata.query_lens) <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the final hidden states of the step's tokens (the model's forward for these inputs), their logits
        (`compute_logits` of them) or None where the model's head is not the kernel's to run)."""
        weights = self._table()
        inner = self.model.model
        rotary = next(iter(inner.rotaries.values()))
        cos, sin = rotary.lookup(positions, weights.dtype)
        rows = input_ids.shape[0]
        hidden, logits = cpu_decode_step.decode_step(weights, input_ids, cos.reshape(rows, -1), sin.reshape(rows, -1),
                                                     metadata.slot_mapping, metadata.block_tables,
                                                     metadata.seq_lens_tensor)
        if logits is not None:
            logits = finish_logits(logits, divisor=self.model.logits_divisor, cap=self.model.final_logit_soft_cap)
        return hidden, logits

    def _weights_dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def _at_4_bits(self, packed: Any) -> cpu_decode_blocks.BlockWeights:
        """A gguf layer's packed blocks at 4 bits where its integers fit (Q4_0, Q4_1: half the bytes a step reads),
        made once (the layer keeps its int8 blocks for the module path: prefill, larger batches)."""
        key = id(packed)
        if key not in self._nibbles:
            self._nibbles[key] = (packed, cpu_block_int8.pack_nibbles(packed) or packed)
        return self._nibbles[key][1]

    def _table(self) -> cpu_decode_step.DecoderWeights:
        """The kernel's table of weights and caches, rebuilt when the caches were (re)allocated."""
        first_cache = self.attention_layers[0].kv_cache[0].data_ptr()
        if self._weights is None or self._bound_cache != first_cache:
            inner = self.model.model
            layers, blocks = [], []
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                key_cache, value_cache = attn.attn.kv_cache
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                packed = [getattr(linear, "gguf_packed", None) for linear in linears]
                blocks.append(None if packed[0] is None else [self._at_4_bits(p) for p in packed])
                qkv, o, gate_up, down = (None,) * 4 if packed[0] is not None else \
                    tuple(linear.weight for linear in linears)
                layers.append((layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up,
                               down, key_cache, value_cache, attn.qkv_proj.bias,
                               None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight))
            first = inner.layers[0].self_attn
            self._weights = cpu_decode_step.DecoderWeights(
                layers, inner.embed_tokens.weight, inner.norm.weight, num_heads=first.num_heads,
                num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, eps=inner.norm.eps, scale=first.attn.scale,
                lm_head=self.model.lm_head.weight if plain_lm_head(self.model, self._weights_dtype()) else None,
                blocks=blocks if any(b is not None for b in blocks) else None)
            self._bound_cache = first_cache
        return self._weights


def why_not(model: Any, attention_layers: list[Any], dtype: torch.dtype, engine_config: EngineConfig) -> str | None:
    """None when the captured step computes what `model`'s modules compute; else the first reason it does not."""
    from asyncengine.attention.torch_paged import TorchPagedBackend
    from asyncengine.models.layers.activation import SiluAndMul
    from asyncengine.models.layers.embedding import VocabParallelEmbedding
    from asyncengine.models.layers.op_registry import native_first
    from asyncengine.models.layers.norm import RMSNorm
    from asyncengine.models.layers.quantization import UnquantizedLinearMethod
    from asyncengine.models.layers.rotary import RotaryEmbedding
    from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
    from asyncengine.models.qwen3 import Qwen3Attention

    config = engine_config
    if config.enforce_eager:
        return "enforce_eager"
    if config.tensor_parallel_size != 1 or config.pipeline_parallel_size != 1:
        return "more than one worker"
    if config.enable_lora or config.kv_transfer is not None:
        return "LoRA or a KV connector"
    if dtype not in cpu_decode_step.SUPPORTED_DTYPES:
        return f"dtype {dtype}"
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} is not a Llama-shaped model"
    inner = model.model
    if type(inner).forward is not LlamaModel.forward or inner.embed_scale is not None \
            or type(inner.embed_tokens) is not VocabParallelEmbedding or type(inner.norm) is not RMSNorm \
            or len(inner.rotaries) != 1:
        return f"{type(inner).__name__} changes the model's forward"
    for op in ("rms_norm", "rotary", "silu_and_mul"):
        if not native_first(op):
            return f"op {op!r} has a provider before native"
    rotary = next(iter(inner.rotaries.values()))
    if type(rotary) is not RotaryEmbedding or not rotary.is_neox_style or rotary.rotary_dim != rotary.head_size:
        return "the rotary embedding is not NeoX over whole heads"
    if len(attention_layers) != len(inner.layers):
        return "attention layers outside the decoder layers"
    for layer in inner.layers:
        reason = _layer_reason(layer, dtype, inner.norm.eps, LlamaDecoderLayer, LlamaAttention, Qwen3Attention,
                               LlamaMLP, RMSNorm, SiluAndMul, UnquantizedLinearMethod, TorchPagedBackend)
        if reason is not None:
            return reason
    tensors = [inner.embed_tokens.weight, inner.norm.weight]
    if not all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return "the embedding or final norm is not a contiguous CPU tensor in the model's dtype"
    if not cpu_decode_step.available(dtype):
        return f"the C kernel is unavailable: {cpu_decode_step.unavailable_reason()}"
    return None


def plain_lm_head(model: Any, dtype: torch.dtype) -> bool:
    """Whether the kernel may run the LM head too: Llama's compute_logits over the built-in head, unquantized,
    without a bias, one rank, its weight a contiguous CPU tensor in the model's dtype."""
    from asyncengine.models.layers.embedding import ParallelLMHead
    from asyncengine.models.llama import LlamaForCausalLM

    head = getattr(model, "lm_head", None)
    return type(model).compute_logits is LlamaForCausalLM.compute_logits and type(head) is ParallelLMHead \
        and head.bias is None and head.tp_size == 1 and getattr(head, "quant_config", None) is None \
        and head.weight.dtype == dtype and head.weight.device.type == "cpu" and head.weight.is_contiguous() \
        and head.weight.dim() == 2


def _layer_reason(layer: Any, dtype: torch.dtype, eps: float, decoder_cls: Any, attention_cls: Any,
                  qk_norm_attention_cls: Any, mlp_cls: Any, norm_cls: Any, act_cls: Any, linear_method: Any,
                  backend_cls: Any) -> str | None:
    name = type(layer).__name__
    if type(layer).forward is not decoder_cls.forward or layer.norm_names != decoder_cls.norm_names \
            or layer.residual_multiplier is not None:
        return f"{name} changes the decoder layer"
    attn, mlp = layer.self_attn, layer.mlp
    head_norms: list[Any] = []
    if type(attn).forward is not attention_cls.forward:
        return f"{type(attn).__name__} changes attention"
    if type(attn).normalize_qk is qk_norm_attention_cls.normalize_qk:  # Qwen3's RMSNorm on each q and k head
        head_norms = [attn.q_norm, attn.k_norm]
        if any(type(norm) is not norm_cls or norm.eps != eps for norm in head_norms):
            return f"{type(attn).__name__}'s head norms are not RMSNorms with the model's eps"
    elif type(attn).normalize_qk is not attention_cls.normalize_qk:
        return f"{type(attn).__name__} changes attention"
    if type(mlp) is not mlp_cls or type(mlp.act) is not act_cls:
        return f"{type(mlp).__name__} is not Llama's SiLU MLP"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not norm_cls or norm.eps != eps for norm in norms):
        return "a norm that is not RMSNorm with the model's eps"
    paged = attn.attn
    if type(paged.backend) is not backend_cls or paged.sliding_window is not None \
            or paged.logits_soft_cap is not None or paged.sinks is not None or paged.kv_cache_group != 0:
        return "attention with another backend, a sliding window, a soft cap or sinks"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    gguf = _gguf_blocks_reason(linears, dtype)
    if gguf not in (None, "not gguf"):
        return gguf
    if gguf is not None and any(type(linear.quant_method) is not linear_method for linear in linears):
        return "quantized linear layers"
    if any(linear.bias is not None for linear in linears[1:]):  # a q/k/v bias (Qwen2) is the kernel's; no other
        return "biases on the o, gate-up or down projections"
    biases = [] if attn.qkv_proj.bias is None else [attn.qkv_proj.bias]
    float_weights = [] if gguf is None else [linear.weight for linear in linears]
    tensors = float_weights + [norm.weight for norm in norms + tuple(head_norms)] + biases
    if not all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return "weights that are not contiguous CPU tensors in the model's dtype"
    return None


def _gguf_blocks_reason(linears: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """None when the four linear layers all run `quantization="gguf"`'s block kernel (packed for `dtype`
    activations) and the step can run them too; "not gguf" when none is a gguf layer; else why the step cannot."""
    from asyncengine.models.layers.gguf_linear import GgufLinearMethod

    kinds = [type(linear.quant_method) is GgufLinearMethod for linear in linears]
    if not any(kinds):
        return "not gguf"
    if not all(kinds) or any(linear.gguf_packed is None or linear.gguf_compute_dtype != dtype for linear in linears):
        return "gguf linear layers without their packed block kernel (no AVX-512 VNNI, or another dtype)"
    if linears[2].gguf_packed.n % 32:
        return "an MLP width that is not a multiple of 16 (the kernel's gate and up tiles)"
    if max(linear.gguf_packed.width for linear in linears) > cpu_decode_blocks.MAX_BLOCK_WIDTH:
        return f"gguf linear layers wider than {cpu_decode_blocks.MAX_BLOCK_WIDTH} inputs"
    if not cpu_decode_step.blocks_available(dtype):
        return "the C kernel was built without AVX-512 VNNI, which its gguf products need"
    return None
