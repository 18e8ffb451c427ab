"""Tiny random-weight mixture-of-experts checkpoints (issue 35), saved as HF directories: Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, GPT-OSS. Two layers, 4 to 8 experts of top-2 (OLMoE top-3), `initializer_range=0.2`; each turns on what
its architecture adds: Qwen3-MoE's renormalised top-k and a dense layer among the sparse ones
(`mlp_only_layers`), Qwen2-MoE's shared expert with its gate and q/k/v biases, Mixtral's sliding window (16
tokens, shorter than the parity prompts) and w1/w2/w3 names, OLMoE's q/k norms over whole projections, GPT-OSS's
sinks (drawn around 1, so they take a real share of the softmax), alternating windows, biases and clamped swiglu.
"""

from __future__ import annotations

from pathlib import Path

import torch

from support.tiny_models import TinyModel, random_causal_lm

WINDOW = 16
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

MOE_SPECS: dict[str, dict] = {
    # 8 experts, renormalised top-2, explicit head_dim, layer 0 dense (mlp_only_layers), untied head
    "qwen3_moe": dict(cls="Qwen3MoeConfig", vocab_size=1049, head_dim=32, intermediate_size=96,
                      moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0],
                      num_hidden_layers=3),
    # 6 experts, not renormalised, a shared expert and its sigmoid gate, q/k/v biases, tied embeddings
    "qwen2_moe": dict(cls="Qwen2MoeConfig", vocab_size=1051, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=6, shared_expert_intermediate_size=48, norm_topk_prob=False,
                      tie_word_embeddings=True),
    # 4 experts, always renormalised, a sliding window on every layer
    "mixtral": dict(cls="MixtralConfig", vocab_size=1061, intermediate_size=48, num_local_experts=4,
                    sliding_window=WINDOW),
    # 8 experts, top-3 not renormalised, q/k norms over the whole projections
    "olmoe": dict(cls="OlmoeConfig", vocab_size=1063, intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                  norm_topk_prob=False, pad_token_id=0),
    # attention sinks, sliding/full alternating, biases everywhere, top-k then softmax, the clamped swiglu (a
    # limit the random activations reach), expert biases; yarn rope as the released models have
    "gpt_oss": dict(cls="GptOssConfig", vocab_size=1069, head_dim=16, intermediate_size=32, num_local_experts=4,
                    sliding_window=WINDOW, swiglu_limit=1.5, pad_token_id=0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False}),
}


def build_moe_model(name: str, directory: Path, *, seed: int = 0, max_position_embeddings: int = 256) -> TinyModel:
    import transformers

    spec = {**COMMON, **MOE_SPECS[name]}
    config = getattr(transformers, spec.pop("cls"))(**spec, max_position_embeddings=max_position_embeddings,
                                                    attn_implementation="eager")
    config._experts_implementation = "eager"
    model = random_causal_lm(config, seed)
    if name == "gpt_oss":  # sinks large enough to take a real share of each row's softmax
        generator = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("sinks"):
                    param.copy_(1.0 + torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return TinyModel(name, directory, model, config.vocab_size)
