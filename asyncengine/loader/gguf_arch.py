"""What each GGUF architecture becomes in HF form: the config.json fields and the tensor names (loader/gguf.py).

A GGUF file states its model as llama.cpp's metadata keys (`<arch>.embedding_length`, ...) and tensor names
(`blk.N.attn_q.weight`). For each architecture the engine runs natively, `ARCHITECTURES` says which HF config the
metadata makes (fields transformers' own config class accepts, `architectures` naming the class the model registry
builds) and which HF tensor each GGUF tensor is, with the two changes llama.cpp's converter made to the weights:

- `llama` (and Mistral, which llama.cpp writes as `llama`, see `_llama_config`): Q and K rows permuted for llama.cpp's rotary, undone
  here (`unpermute_rotary_rows`). The others (Qwen2, Qwen3, Gemma 2 and 3, Phi-3) use the rotary layout as HF has it.
- Gemma 2 and 3: every RMSNorm weight stored as `1 + w` (Gemma's norm multiplies by `1 + w`); written back as
  `w` (the file's value less 1 in float32, as transformers' GGUF loader does).

Mixtures of experts (`qwen3moe`, `qwen2moe`, and `llama` files with `llama.expert_count`, which is how llama.cpp
writes Mixtral): the router `ffn_gate_inp` becomes `mlp.gate.weight`; the experts' stacked `ffn_gate_exps`,
`ffn_up_exps` (`[E, I, H]` each) and `ffn_down_exps` (`[E, H, I]`) become `mlp.experts.gate_proj`, `up_proj`,
`down_proj` (FusedMoE loads the first two into its gate and up halves); Qwen2-MoE's shared expert
(`ffn_{gate,up,down}_shexp`) and its gate (`ffn_gate_inp_shexp`, a vector in the file, `[1, H]` in HF form) keep
HF's names. The files do not say which layers are dense or whether the router's top-k weights are renormalised:
a layer without `ffn_gate_inp` is dense (`mlp_only_layers`), and the renormalisation is
`<arch>.expert_weights_norm` where the file states it, else what llama.cpp does for the architecture (Qwen3-MoE
and Mixtral yes, Qwen2-MoE no).

Where llama.cpp derives a value from the architecture instead of storing it, this module does the same: Gemma's
attention scale (`query_pre_attn_scalar`: the head size, or hidden / heads for the 27B models), Gemma 3's rotary
base on sliding layers (10000 unless `rope.freq_base_swa` says otherwise) and its sliding pattern (five sliding
layers, then a global one, unless `attention.sliding_window_pattern` says otherwise), Gemma 2's alternation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncengine.errors import ModelLoadError


class Metadata:
    """Typed access to the GGUF key-value fields, with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        found = self._fields.get(key)
        return default if found is None else found.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self._fields[key].contents()


@dataclass(frozen=True)
class Architecture:
    gguf_name: str
    config: Callable[[Metadata, set[str]], dict[str, Any]]  # (metadata, the file's tensor names) -> config.json
    # GGUF per-layer tensor (after `blk.N.`) -> HF name inside `model.layers.N.`
    layer_tensors: dict[str, str]
    rotary_rows_permuted: bool = False
    norms_stored_plus_one: bool = False
    # GGUF global tensors the config consumes instead of the checkpoint (Phi-3's long-rope factors)
    config_tensors: frozenset[str] = field(default_factory=frozenset)
    # Mixtures of experts: the per-layer tensors of a sparse layer in place of the dense MLP's (`_MLP`)
    moe_tensors: dict[str, str] = field(default_factory=dict)
    # q/k norms over the whole projection (OLMoE's, OLMo 2's) rather than per head (Qwen3's)
    qk_norms_whole: bool = False


GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_MOE = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj",
        "ffn_up_exps.weight": "mlp.experts.up_proj", "ffn_down_exps.weight": "mlp.experts.down_proj"}
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                  "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
# HF tensors a GGUF file stores as a vector: reshaped to HF's shape on conversion.
VECTORS_AS_ROWS = frozenset({"mlp.shared_expert_gate.weight"})
_QKV_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias"}
# Gemma's four norms around each block: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _common(meta: Metadata, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The fields every decoder's config has, from `<arch>.*` and `tokenizer.ggml.*`."""
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_heads = meta.require(f"{arch}.attention.head_count")
    n_kv_heads = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_heads, list) or isinstance(n_kv_heads, list):
        raise ModelLoadError(f"{meta.path}: head counts that differ per layer are not supported ({arch})")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.require("tokenizer.ggml.tokens"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": int(n_heads),
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // int(n_heads))),
        "rms_norm_eps": float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": int(vocab),
        # llama.cpp writes output.weight only when the model does not tie it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        "unk_token_id": _opt_int(meta.get("tokenizer.ggml.unknown_token_id")),
        "torch_dtype": "float32",
    }


def _rope(meta: Metadata, arch: str, *, default_theta: float = 10000.0) -> dict[str, Any]:
    """`rope_parameters` (transformers 5's name) from `<arch>.rope.*`: default, linear or yarn scaling; other
    kinds (and llama 3's `rope_freqs` tensor, checked by the caller) are refused rather than guessed."""
    theta = float(meta.get(f"{arch}.rope.freq_base", default_theta))
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and factor is not None and original is not None:
        return {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                "original_max_position_embeddings": int(original)}
    raise ModelLoadError(f"{meta.path}: RoPE scaling {kind!r} (factor {factor}) of a {arch} GGUF file is not "
                         "supported: convert the model from its HF checkpoint instead")


def _with_rope(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 reads rope_parameters; older readers look for rope_theta (and rope_scaling).
    config["rope_parameters"] = rope
    config["rope_theta"] = rope["rope_theta"]
    if rope["rope_type"] != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config


def _experts(meta: Metadata, arch: str, names: set[str], layers: int, *, renormalize: bool) -> dict[str, Any]:
    """The mixture-of-experts fields: counts, renormalisation (`renormalize`: llama.cpp's rule for `arch`
    where the file states none) and the dense layers (those without a router)."""
    norm = meta.get(f"{arch}.expert_weights_norm")
    return {"num_experts": int(meta.require(f"{arch}.expert_count")),
            "num_experts_per_tok": int(meta.require(f"{arch}.expert_used_count")),
            "norm_topk_prob": renormalize if norm is None else bool(norm),
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
            "decoder_sparse_step": 1}


def _llama_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{meta.path}: llama 3's scaled RoPE (the rope_freqs tensor) is not supported: "
                             "convert the model from its HF checkpoint instead")
    config = _with_rope(_common(meta, "llama", names), _rope(meta, "llama"))
    config.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    if meta.get("llama.expert_count"):  # how llama.cpp writes Mixtral: every layer sparse, always renormalised
        moe = _experts(meta, "llama", names, config["num_hidden_layers"], renormalize=True)
        if moe["mlp_only_layers"] or not moe["norm_topk_prob"]:
            raise ModelLoadError(f"{meta.path}: a llama file with experts is read as Mixtral, whose layers are all "
                                 "sparse with renormalised router weights; this one has dense layers "
                                 f"{moe['mlp_only_layers']} or expert_weights_norm false")
        window = meta.get("llama.attention.sliding_window")
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                      num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                      sliding_window=None if window is None else int(window))
        return config
    # llama.cpp writes Mistral's models as llama files, without their sliding window (Mistral 7B v0.2 and later
    # have none): as llama they compute what MistralForCausalLM would, which is what transformers' and vLLM's GGUF
    # loaders make of them too. A file that does state a window is a Mistral with one.
    window = meta.get("llama.attention.sliding_window")
    if window is not None:
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=int(window))
    else:
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    return config


def _qwen2_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    config = _with_rope(_common(meta, "qwen2", names), _rope(meta, "qwen2"))
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                  use_sliding_window=False)
    return config


def _qwen3_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    config = _with_rope(_common(meta, "qwen3", names), _rope(meta, "qwen3"))
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False)
    return config


def _qwen_moe_config(meta: Metadata, names: set[str], arch: str) -> dict[str, Any]:
    config = _with_rope(_common(meta, arch, names), _rope(meta, arch))
    config.update(_experts(meta, arch, names, config["num_hidden_layers"], renormalize=arch == "qwen3moe"))
    config["moe_intermediate_size"] = int(meta.require(f"{arch}.expert_feed_forward_length"))
    if arch == "qwen3moe":
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
                      attention_bias=False)
    else:
        config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_act="silu",
                      qkv_bias=True, use_sliding_window=False, shared_expert_intermediate_size=int(
                          meta.get("qwen2moe.expert_shared_feed_forward_length", 0) or 0))
    return config


def _olmoe_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    """llama.cpp's `olmoe` (OlmoeModel in its converter): every layer sparse, the experts `feed_forward_length`
    wide (HF's intermediate_size), router weights never renormalised (llama.cpp's graph hard-codes it, as
    OLMoE's released configs do), rotary on halves (no row permutation), q/k norms over the whole projection."""
    config = _with_rope(_common(meta, "olmoe", names), _rope(meta, "olmoe"))
    moe = _experts(meta, "olmoe", names, config["num_hidden_layers"], renormalize=False)
    if moe["mlp_only_layers"]:
        raise ModelLoadError(f"{meta.path}: an olmoe file whose layers {moe['mlp_only_layers']} have no router: "
                             "OLMoE's layers are all sparse")
    clamp = meta.get("olmoe.attention.clamp_kqv")
    config.update(architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_act="silu", attention_bias=False,
                  num_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                  norm_topk_prob=moe["norm_topk_prob"], clip_qkv=None if clamp is None else float(clamp))
    return config


def _gemma_attention_scalar(config: dict[str, Any], large_model_layers: int) -> int:
    # llama.cpp: 1 / sqrt(head size), but 1 / sqrt(hidden / heads) for the 27B models (named by their depth).
    if config["num_hidden_layers"] == large_model_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _sliding_layers(meta: Metadata, arch: str, layers: int, default_period: int) -> list[str]:
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):  # one flag per layer, true where the layer slides
        if len(pattern) != layers:
            raise ModelLoadError(f"{meta.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} flags "
                                 f"for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:  # a period: every layer slides but the last of each period
        period = int(pattern)
        sliding = [period > 1 and i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _gemma2_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    config = _with_rope(_common(meta, "gemma2", names), _rope(meta, "gemma2"))
    softcap = {key: meta.get(f"gemma2.{key}") for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    config.update(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(meta.require("gemma2.attention.sliding_window")),
        layer_types=_sliding_layers(meta, "gemma2", config["num_hidden_layers"], 2),
        query_pre_attn_scalar=_gemma_attention_scalar(config, 46),
        **{key: None if value is None else float(value) for key, value in softcap.items()},
    )
    return config


def _gemma3_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    config = _common(meta, "gemma3", names)
    full = _rope(meta, "gemma3", default_theta=1_000_000.0)
    local = {"rope_type": "default", "rope_theta": float(meta.get("gemma3.rope.freq_base_swa", 10000.0))}
    config.update(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(meta.require("gemma3.attention.sliding_window")),
        layer_types=_sliding_layers(meta, "gemma3", config["num_hidden_layers"], 6),
        query_pre_attn_scalar=_gemma_attention_scalar(config, 62),
        attn_logit_softcapping=None, final_logit_softcapping=None,
        rope_parameters={"full_attention": full, "sliding_attention": local},
        # the same for readers of transformers 4's names
        rope_theta=full["rope_theta"], rope_local_base_freq=local["rope_theta"],
    )
    if full["rope_type"] != "default":
        config["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    return config


def _phi3_config(meta: Metadata, names: set[str]) -> dict[str, Any]:
    config = _common(meta, "phi3", names)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("phi3.rope.freq_base", 10000.0))}
    rotary = meta.get("phi3.rope.dimension_count")
    if rotary is not None and int(rotary) != config["head_dim"]:
        rope["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    original = meta.get("phi3.rope.scaling.original_context_length")
    config["original_max_position_embeddings"] = int(original) if original is not None else \
        config["max_position_embeddings"]
    window = meta.get("phi3.attention.sliding_window")
    config.update(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu",
                  sliding_window=None if window is None else int(window))
    config["rope_parameters"] = rope
    config["rope_theta"] = rope["rope_theta"]
    return config


def phi3_long_rope(config: dict[str, Any], factors: dict[str, np.ndarray]) -> None:
    """Phi-3's long-context rotary: llama.cpp keeps its per-frequency factors as two tensors; HF as lists."""
    if not factors:
        return
    if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ModelLoadError(f"a phi3 GGUF file with {sorted(factors)} but not both long and short rope factors")
    config["rope_parameters"].update(
        rope_type="longrope", long_factor=[float(x) for x in factors["rope_factors_long.weight"]],
        short_factor=[float(x) for x in factors["rope_factors_short.weight"]])
    config["rope_scaling"] = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _llama_config, {**_PRE_NORMS, **_ATTENTION, **_MLP}, rotary_rows_permuted=True,
                          moe_tensors=_MOE),
    "qwen3moe": Architecture("qwen3moe", lambda meta, names: _qwen_moe_config(meta, names, "qwen3moe"),
                             {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, moe_tensors=_MOE),
    "qwen2moe": Architecture("qwen2moe", lambda meta, names: _qwen_moe_config(meta, names, "qwen2moe"),
                             {**_PRE_NORMS, **_ATTENTION, **_QKV_BIASES, **_MLP},
                             moe_tensors={**_MOE, **_SHARED_EXPERT}),
    "olmoe": Architecture("olmoe", _olmoe_config, {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS}, moe_tensors=_MOE,
                          qk_norms_whole=True),
    "qwen2": Architecture("qwen2", _qwen2_config, {**_PRE_NORMS, **_ATTENTION, **_QKV_BIASES, **_MLP}),
    "qwen3": Architecture("qwen3", _qwen3_config, {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}),
    "gemma2": Architecture("gemma2", _gemma2_config, {**_GEMMA_NORMS, **_ATTENTION, **_MLP},
                           norms_stored_plus_one=True),
    "gemma3": Architecture("gemma3", _gemma3_config, {**_GEMMA_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP},
                           norms_stored_plus_one=True),
    # llama.cpp keeps Phi-3's fused projections as HF has them: qkv_proj, and gate_up_proj (gate rows first).
    "phi3": Architecture("phi3", _phi3_config, {
        **_PRE_NORMS, "attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    }, config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
}


def architecture(meta: Metadata) -> Architecture:
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ModelLoadError(f"{meta.path}: GGUF architecture {name!r} is not supported; the converter reads "
                             f"{', '.join(sorted(ARCHITECTURES))} (docs/models.md, GGUF)")
    return ARCHITECTURES[name]


def hf_tensor_name(arch: Architecture, gguf_name: str, n_layers: int) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)  # blk.N.<kind>.<weight|bias>
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
        suffix = arch.layer_tensors.get(parts[2]) or arch.moe_tensors.get(parts[2])
        if suffix is not None:
            return f"model.layers.{parts[1]}.{suffix}"
    return None


def expected_shapes(arch: Architecture, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the checkpoint must have, with its shape."""
    h, inter, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    per_suffix = {
        "self_attn.q_proj.weight": (q_rows, h), "self_attn.k_proj.weight": (kv_rows, h),
        "self_attn.v_proj.weight": (kv_rows, h), "self_attn.o_proj.weight": (h, q_rows),
        "self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,), "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, h),
        "self_attn.q_norm.weight": (q_rows,) if arch.qk_norms_whole else (head,),
        "self_attn.k_norm.weight": (kv_rows,) if arch.qk_norms_whole else (head,),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        "mlp.gate_up_proj.weight": (2 * inter, h),
    }
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts:
        # Mixtral's experts are intermediate_size wide; the Qwen MoEs' moe_intermediate_size.
        expert_inter = int(config.get("moe_intermediate_size") or inter)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        per_suffix.update({
            "mlp.gate.weight": (experts, h), "mlp.experts.gate_proj": (experts, expert_inter, h),
            "mlp.experts.up_proj": (experts, expert_inter, h), "mlp.experts.down_proj": (experts, h, expert_inter),
            "mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight": (shared, h),
            "mlp.shared_expert.down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h)})
    dense_layers = set(config.get("mlp_only_layers") or ())
    dense_mlp = set(_MLP.values())
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h),
                                          "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        sparse = bool(experts) and i not in dense_layers
        suffixes = [suffix for suffix in arch.layer_tensors.values() if not (sparse and suffix in dense_mlp)]
        if sparse:
            suffixes += [suffix for suffix in arch.moe_tensors.values()
                         if config.get("shared_expert_intermediate_size") or suffix not in _SHARED_EXPERT.values()]
        for suffix in suffixes:
            shapes[f"model.layers.{i}.{suffix}"] = per_suffix.get(suffix, (h,))  # the rest are norms of hidden
    return shapes


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a llama Q or K projection (weight rows or bias entries).

    HF llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs,
    so its converter interleaves each head's rows: row (h, i, j) <- HF row (h, j, i) for
    i < head_dim/2, j in {0, 1}. Reading the rows back as (h, i, j) and swapping i and j restores
    the HF order (h, j, i).
    """
    rows = w.shape[0]
    rest = w.shape[1:]
    half = rows // n_head // 2
    if n_head * 2 * half != rows:
        raise ModelLoadError(f"cannot un-permute a {w.shape} projection over {n_head} heads")
    return np.ascontiguousarray(w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest))
