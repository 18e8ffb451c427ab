"""Tiny random-weight checkpoints of the native architectures beyond Llama/Qwen (issue 34), saved as HF directories.

Each config turns on what its architecture adds, small enough to run in-process in a fraction of a second:
sliding windows (16 tokens, shorter than the parity prompts) alternating with full layers, soft caps, per-type
rope bases with scaling, LongRoPE past its original context, partial and interleaved rotary, the multipliers.
`initializer_range=0.2` and randomized norm weights and biases (tests/support/tiny_models.py's random_causal_lm).
"""

from __future__ import annotations

from pathlib import Path

from support.tiny_models import TinyModel, random_causal_lm

WINDOW = 16
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

SPECS: dict[str, dict] = {
    # every layer sliding, explicit head_dim
    "mistral": dict(cls="MistralConfig", num_hidden_layers=3, head_dim=32, vocab_size=1009, sliding_window=WINDOW,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # sliding/full alternating (transformers' default layer_types), both soft caps, GeGLU, query_pre_attn_scalar
    "gemma2": dict(cls="Gemma2Config", num_hidden_layers=4, head_dim=16, vocab_size=1013, sliding_window=WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                   pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # three sliding layers and a full one (4 KV cache groups of one slot), local and global rope (the global
    # one linearly scaled), q/k norms
    "gemma3": dict(cls="Gemma3TextConfig", num_hidden_layers=4, head_dim=16, vocab_size=1019, sliding_window=WINDOW,
                   query_pre_attn_scalar=16, pad_token_id=0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                                       "factor": 2.0}}),
    # fused checkpoint projections, partial rotary, LongRoPE whose original context (64) the decode passes,
    # a sliding window on every layer
    "phi3": dict(cls="Phi3Config", num_hidden_layers=2, vocab_size=1021, pad_token_id=0, sliding_window=24,
                 original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.05 * i for i in range(6)],
                                  "long_factor": [1.5 + 0.25 * i for i in range(6)]}),
    # norms after each block only, q/k norms over the whole projections
    "olmo2": dict(cls="Olmo2Config", num_hidden_layers=3, vocab_size=1031, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    # the four multipliers, tied embeddings
    "granite": dict(cls="GraniteConfig", num_hidden_layers=2, vocab_size=1033, tie_word_embeddings=True,
                    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # sandwich norms, q/k/v bias, fused gate/up, interleaved rotary on half of each head
    "glm4": dict(cls="Glm4Config", num_hidden_layers=2, head_dim=32, vocab_size=1039, pad_token_id=0,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def build_native_model(name: str, directory: Path, *, seed: int = 0, max_position_embeddings: int = 256) -> TinyModel:
    import transformers

    spec = dict(SPECS[name])
    config = getattr(transformers, spec.pop("cls"))(**COMMON, **spec, max_position_embeddings=max_position_embeddings,
                                                    attn_implementation="eager")
    model = random_causal_lm(config, seed, norm_centre=0.0 if "gemma" in name else 1.0)  # Gemma's: w of (1 + w)
    model.save_pretrained(directory)
    return TinyModel(name, directory, model, config.vocab_size)
