"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints, saved as HF directories.

`initializer_range=0.2` makes the logits sharp (the default 0.02 gives nearly flat logits, where
greedy decoding is decided by rounding noise). Norm weights and biases are randomized too, since
transformers initializes them to ones and zeros, which would leave their loading untested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# Each spec covers something the parity acceptance asks for.
SPECS = {
    # GQA 3:1, untied embeddings, odd vocabulary, non-default rope_theta
    "llama": dict(
        cls="LlamaConfig", hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=997, rope_theta=5000.0, tie_word_embeddings=False,
    ),
    # qkv bias, GQA 1:1, tied embeddings, rope_theta 1e6
    "qwen2": dict(
        cls="Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1001, rope_theta=1_000_000.0, tie_word_embeddings=True,
    ),
    # q/k norm, explicit head_dim different from hidden/heads, GQA 2:1
    "qwen3": dict(
        cls="Qwen3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1003, rope_theta=20000.0, tie_word_embeddings=False,
    ),
}


@dataclass
class TinyModel:
    name: str
    path: Path
    hf_model: torch.nn.Module  # transformers' model, float32, eager attention
    vocab_size: int


def build_tiny_model(name: str, directory: Path, *, seed: int = 0, max_position_embeddings: int = 512) -> TinyModel:
    import transformers

    spec = dict(SPECS[name])
    config_cls = getattr(transformers, spec.pop("cls"))
    rope_theta = spec.pop("rope_theta")
    config = config_cls(
        **spec,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    model = random_causal_lm(config, seed)
    model.save_pretrained(directory)
    return TinyModel(name, directory, model, config.vocab_size)


def random_causal_lm(config, seed: int, *, norm_centre: float = 1.0) -> torch.nn.Module:
    """transformers' causal LM for `config`, float32 and eager, its weights drawn from `seed` and its norm weights
    and biases randomized too (`norm_centre` 0 for norms that hold w of (1 + w), as Gemma's do)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(norm_centre + 0.2 * torch.randn(param.shape, generator=generator))
            elif param_name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()
