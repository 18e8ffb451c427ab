"""EAGLE and EAGLE-3 heads in their checkpoints' layouts (config.json and safetensors), built for tests: random
heads, and heads whose weights make them propose a "bigram" target's own greedy tokens (tests/spec_decode)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from support.tiny_models import random_causal_lm

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, THETA, EPS = 96, 6, 2, 160, 997, 5000.0, 1e-6
HEAD_DIM = HIDDEN // HEADS


def head_config(method: str, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else "EagleLlamaForCausalLM"],
            "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
            "num_attention_heads": extra.pop("heads", HEADS), "num_key_value_heads": extra.pop("kv_heads", KV_HEADS),
            "num_hidden_layers": 1, "rms_norm_eps": EPS, "vocab_size": VOCAB, "rope_theta": THETA,
            "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False, **extra}


def save_head(directory, config: dict, tensors: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    return str(directory)


def random_tensors(method: str, seed: int, heads: int = HEADS, kv_heads: int = KV_HEADS) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return torch.randn(shape, generator=generator) * (scale or shape[-1] ** -0.5) * 1.5

    def norm():
        return 1.0 + 0.2 * torch.randn(HIDDEN, generator=generator)

    head_dim = HIDDEN // heads
    layer = "midlayer" if method == "eagle3" else "layers.0"
    qkv_in = 2 * HIDDEN if method == "eagle3" else HIDDEN
    tensors = {f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, qkv_in),
               f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, qkv_in),
               f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, qkv_in),
               f"{layer}.self_attn.o_proj.weight": rand(HIDDEN, heads * head_dim),
               f"{layer}.mlp.gate_proj.weight": rand(FFN, HIDDEN), f"{layer}.mlp.up_proj.weight": rand(FFN, HIDDEN),
               f"{layer}.mlp.down_proj.weight": rand(HIDDEN, FFN),
               f"{layer}.post_attention_layernorm.weight": norm()}
    if method == "eagle3":
        tensors |= {"fc.weight": rand(HIDDEN, 3 * HIDDEN), "midlayer.input_layernorm.weight": norm(),
                    "midlayer.hidden_norm.weight": norm(), "norm.weight": norm(),
                    "lm_head.weight": rand(VOCAB - 97, HIDDEN, scale=0.3),
                    # A draft vocabulary of VOCAB - 97 ids, draft id i meaning target id i + 97 * (i odd).
                    "d2t": torch.where(torch.arange(VOCAB - 97) % 2 == 1, 97, 0),
                    "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    else:
        tensors |= {"fc.weight": rand(HIDDEN, 2 * HIDDEN), "fc.bias": 0.1 * torch.randn(HIDDEN, generator=generator)}
    return tensors


def transformers_llama(layers: int, seed: int):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.2,
        rms_norm_eps=EPS, rope_parameters={"rope_type": "default", "rope_theta": THETA}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return random_causal_lm(config, seed)



def bigram_llama(seed: int = 7):
    """A 3-layer transformers Llama whose next token depends on the current token only: attention's and (in
    layers 1 and 2) the MLP's output projections zeroed; unit-RMS embedding rows and unit final norm (see
    copying_head)."""
    hf = transformers_llama(3, seed=seed)
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        embed.copy_(embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True)))
        hf.model.norm.weight.fill_(1.0)
        for index, layer in enumerate(hf.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            if index:
                layer.mlp.down_proj.weight.zero_()
    return hf


def copying_head(method: str, hf) -> tuple[dict, dict]:
    """EAGLE: fc passes the embedding, the layer's attention adds nothing, its MLP is the target's. EAGLE-3:
    the hidden state is zeroed (hidden_norm's weight 0, with norm_before_residual, so the residual is that
    norm: the state fed back from a draft row adds nothing either), attention looks at its own row only (q and k a large constant on the first rotary pair, whose
    angle differs for every distance below 44) and copies the normed embedding through v and o, then the
    target's MLP, final norm (unit) and lm_head."""
    layer0 = hf.model.layers[0]
    t = {k: v.detach().clone() for k, v in random_tensors(method, seed=3).items()}
    prefix = "midlayer" if method == "eagle3" else "layers.0"
    t[f"{prefix}.post_attention_layernorm.weight"] = layer0.post_attention_layernorm.weight.detach().clone()
    for name in ("gate_proj", "up_proj", "down_proj"):
        t[f"{prefix}.mlp.{name}.weight"] = getattr(layer0.mlp, name).weight.detach().clone()
    if method == "eagle":
        t["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
        t["fc.bias"] = torch.zeros(HIDDEN)
        t["layers.0.self_attn.o_proj.weight"].zero_()
        return head_config(method), t
    heads = HIDDEN // 16
    selector = torch.zeros(heads * 16)
    selector[::16] = 200.0
    t |= {"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN), "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
          "midlayer.hidden_norm.weight": torch.zeros(HIDDEN), "norm.weight": torch.ones(HIDDEN),
          "lm_head.weight": hf.lm_head.weight.detach().clone(), "d2t": torch.zeros(VOCAB, dtype=torch.long),
          "midlayer.self_attn.q_proj.weight": torch.zeros(HIDDEN, 2 * HIDDEN),
          "midlayer.self_attn.k_proj.weight": torch.zeros(HIDDEN, 2 * HIDDEN),
          "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1),
          "midlayer.self_attn.o_proj.weight": torch.eye(HIDDEN),
          "midlayer.self_attn.q_proj.bias": selector, "midlayer.self_attn.k_proj.bias": selector.clone(),
          "midlayer.self_attn.v_proj.bias": torch.zeros(HIDDEN), "midlayer.self_attn.o_proj.bias": torch.zeros(HIDDEN)}
    del t["t2d"]
    config = head_config(method, heads=heads, kv_heads=heads, attention_bias=True, norm_before_residual=True,
                         eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    return config, t
