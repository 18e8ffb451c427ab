"""A tiny HF mixture-of-experts model (tests/support/moe_models.py) written as a GGUF file the way llama.cpp's
converter writes one: its metadata keys (`<arch>.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length`; for `olmoe` only the counts, as llama.cpp's OlmoeModel writes), its tensor names
(`blk.N.ffn_gate_inp`, the stacked `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, Qwen2-MoE's `*_shexp`), Mixtral as
a `llama` file with its Q and K rows permuted for llama.cpp's rotary, and a byte-level BPE vocabulary as long as the
model's. Every tensor in float32, so that the file holds exactly the HF model's weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support.tiny_gguf import GPT2_SPECIALS, _gpt2_vocab
from support.tiny_models import TinyModel

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
}


def _permute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of a llama Q or K projection (the converter undoes it)."""
    return np.ascontiguousarray(w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


def write_moe_gguf(model: TinyModel, path: Path) -> Path:
    import gguf

    config = model.hf_model.config
    arch = GGUF_ARCH[model.name]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {model.name}")
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # (llama.cpp's OlmoeModel writes 1e-5, OLMoE's released value, whatever the config says; the tiny models' is 1e-6)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if arch not in ("llama", "olmoe"):  # those two: the experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))
    if getattr(config, "sliding_window", None) and arch == "llama":
        writer.add_uint32("llama.attention.sliding_window", int(config.sliding_window))
    _add_vocabulary(writer, int(config.vocab_size))

    heads = {"attn_q": int(config.num_attention_heads), "attn_k": int(config.num_key_value_heads)}
    for name, tensor in model.hf_model.state_dict().items():
        w = tensor.detach().float().numpy()
        if name in GLOBAL:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            writer.add_tensor(GLOBAL[name], w)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first: llama.cpp keeps them apart
            inner = w.shape[1] // 2
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, :inner]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[:, inner:]))
            continue
        if rest == "mlp.shared_expert_gate.weight":  # [1, H] in HF, a vector in the file
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp_shexp.weight", np.ascontiguousarray(w.reshape(-1)))
            continue
        stem, _, kind = rest.rpartition(".")
        gguf_name = LAYER.get(rest)
        if gguf_name is None and kind == "bias":  # the q/k/v biases of Qwen2-MoE
            gguf_name = LAYER[f"{stem}.weight"]
            kind_suffix = "bias"
        else:
            kind_suffix = "weight"
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {name}")
        if arch == "llama" and gguf_name in heads:
            w = _permute_rotary_rows(w, heads[gguf_name])
        writer.add_tensor(f"blk.{layer}.{gguf_name}.{kind_suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer, vocab_size: int) -> None:
    """tiny_gguf's byte-level BPE, padded with unused tokens to the model's vocabulary size."""
    import gguf

    tokens, merges = _gpt2_vocab()
    tokens = tokens + [f"<unused_{i}>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in GPT2_SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
