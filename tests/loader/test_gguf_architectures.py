"""GGUF beyond llama (loader/gguf_arch.py, loader/gguf_kquants.py): a tiny file of each architecture the converter
reads, with K-quant tensors, converts to what transformers makes of the same file (its config fields, every tensor
bit for bit, the tokenizer's ids), keeps its linear weights' blocks (K-quants exactly, Q6_K within its bound, Q2_K
named as not kept), and a Qwen3 file of K-quants runs in the engine greedy-identical to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.loader import gguf_blocks
from asyncengine.loader.gguf import convert_gguf_to_hf_dir
from asyncengine.loader.gguf_kquants import q6_k_error_bound
from support.tiny_gguf import TinySpec, gpt2_reference_tokenizer, write_tiny_gguf

K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q3_K", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_1", "ffn_down": "Q2_K"}
SPECS = {
    # transformers' qwen3 GGUF reading takes head_dim from Qwen3Config's default (128), not from the file
    "qwen3": TinySpec("qwen3", "gpt2", heads=2, kv_heads=1, head_dim=128, types=K_TYPES),
    "qwen2": TinySpec("qwen2", "gpt2", tied=True, kv_heads=4),
    "llama": TinySpec("llama", "llama", name="Mistral tiny", types=K_TYPES),
    "gemma2": TinySpec("gemma2", "llama", tied=True, extra={
        "attention.sliding_window": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": TinySpec("gemma3", "llama", tied=True, layers=6, kv_heads=1, types={**K_TYPES, "ffn_down": "Q6_K"},
                       extra={"attention.sliding_window": 64}),
    "phi3": TinySpec("phi3", "llama", kv_heads=4, types={"attn_qkv": "Q5_K", "ffn_up": "Q4_K"},
                     extra={"attention.sliding_window": 100}),
}
NATIVE = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
          "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Where we differ from transformers' reading of a GGUF file, on purpose (docs/models.md, GGUF):
# Gemma's attention scale as llama.cpp derives it (head size; transformers takes Gemma's default 256 whatever
# the head size), Phi-3's sliding window as the file states it (transformers drops it), and Phi-3's original
# context (the file's context when it states no scaling; transformers: Phi3Config's default 4096).
DIFFERENCES = {"gemma2": {"query_pre_attn_scalar": (64, 256)}, "gemma3": {"query_pre_attn_scalar": (64, 256)},
               "phi3": {"sliding_window": (100, None), "original_max_position_embeddings": (512, 4096)}}
FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
          "eos_token_id", "pad_token_id", "rope_parameters", "sliding_window", "layer_types", "query_pre_attn_scalar",
          "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation", "hidden_act", "model_type",
          "original_max_position_embeddings"]
TEXTS = ["Hello, world! The quick brown fox jumps over the lazy dog.", "  two spaces\n\n\tand tabs  ",
         "def square(x):\n    return x * x  # 1234567890", "héllo wörld 世界 🙂", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each spec's file and its converted directory (about 1 s each)."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    files = {name: write_tiny_gguf(folder / f"{name}.gguf", spec, seed=index)
             for index, (name, spec) in enumerate(SPECS.items())}
    return {name: (path, convert_gguf_to_hf_dir(path, folder / "cache", progress=False))
            for name, path in files.items()}


@pytest.fixture(scope="module")
def transformers_reading(converted):
    """transformers' own reading of each file (`from_pretrained(dir, gguf_file=...)`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    readings = {}
    for name, (path, _) in converted.items():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        readings[name] = model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return readings


@pytest.mark.parametrize("arch", SPECS)
def test_config_is_what_transformers_reads(arch, converted, transformers_reading):
    from transformers import AutoConfig

    raw = json.loads((converted[arch][1] / "config.json").read_text())
    assert raw["architectures"] == [NATIVE[arch]]
    ours, theirs = AutoConfig.from_pretrained(converted[arch][1]), transformers_reading[arch][0].config
    expected_differences = DIFFERENCES.get(arch, {})
    for name in FIELDS:
        mine, reference = getattr(ours, name, None), getattr(theirs, name, None)
        if name in expected_differences:
            assert (mine, reference) == expected_differences[name], name
        elif name == "head_dim" and reference is None:  # transformers derives it: hidden / heads
            assert mine == ours.hidden_size // ours.num_attention_heads
        else:
            assert mine == reference, (name, mine, reference)
    if arch == "gemma2":
        assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0)
        assert ours.layer_types == ["sliding_attention", "full_attention"]
    if arch == "gemma3":
        assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert ours.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


@pytest.mark.parametrize("arch", SPECS)
def test_every_tensor_is_what_transformers_reads(arch, converted, transformers_reading):
    ours = load_file(converted[arch][1] / "model.safetensors")
    theirs = transformers_reading[arch][0].state_dict()
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if SPECS[arch].tied else set())
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_gemma_norms_are_the_files_values_less_one(converted):
    import gguf

    path, directory = converted["gemma3"]
    reader = gguf.GGUFReader(path)
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    ours = load_file(directory / "model.safetensors")
    for gguf_name, hf_name in [("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
                               ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        assert np.array_equal(ours[hf_name].numpy(), stored[gguf_name] - np.float32(1))


@pytest.mark.parametrize("arch", SPECS)
def test_the_tokenizer_gives_transformers_ids(arch, converted, transformers_reading):
    from transformers import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(converted[arch][1]), transformers_reading[arch][1]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True).strip() == \
            theirs.decode(theirs.encode(text), skip_special_tokens=True).strip()
    if SPECS[arch].tokenizer == "gpt2":  # and the trained tokenizer the file's vocabulary and merges came from
        reference = gpt2_reference_tokenizer()
        for text in TEXTS:
            assert ours.encode(text) == reference.encode(text).ids, text
        assert ours.chat_template == theirs.chat_template and ours.chat_template


def test_k_quant_blocks_are_kept_exactly_and_q6_k_within_its_bound(converted):
    directory = converted["qwen3"][1]
    summary = json.loads((directory / "config.json").read_text())[gguf_blocks.CONFIG_KEY]
    assert summary["kept_types"] == ["Q3_K", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
    assert summary["not_kept"] == {f"model.layers.{i}.mlp.down_proj.weight": "Q2_K" for i in range(2)}
    assert 0 < summary["requantized"]["Q6_K"] < 1 / 200  # about Q8_0's own error: 1/254 of the largest weight
    floats = load_file(directory / "model.safetensors")
    with safe_open(str(directory / gguf_blocks.BLOCKS_FILE), framework="np") as blocks:
        for layer in range(2):
            for name, kind in [("self_attn.q_proj", "Q4_K"), ("self_attn.k_proj", "Q5_K"),
                               ("self_attn.o_proj", "Q3_K"), ("mlp.gate_proj", "Q4_K"), ("self_attn.v_proj", "Q6_K")]:
                key = f"model.layers.{layer}.{name}.weight"
                offset = blocks.get_tensor(f"{key}.offset") if f"{key}.offset" in blocks.keys() else None
                scale = blocks.get_tensor(f"{key}.scale")
                w = gguf_blocks.dequantize_blocks(blocks.get_tensor(f"{key}.q"), scale, offset)
                if kind == "Q6_K":
                    bound = np.repeat(q6_k_error_bound(scale), gguf_blocks.BLOCK, axis=1)
                    assert (np.abs(w - floats[key].numpy()) <= bound * (1 + 1e-6)).all(), key
                else:
                    assert np.array_equal(w, floats[key].numpy()), key


def test_quantization_gguf_names_the_weights_it_cannot_keep(converted):
    from types import SimpleNamespace

    from asyncengine.models.layers.gguf_linear import GgufConfig

    config = json.loads((converted["qwen3"][1] / "config.json").read_text())
    engine = SimpleNamespace(model="qwen3.gguf", load_format="auto", tensor_parallel_size=1)
    with pytest.raises(ConfigError, match=r"down_proj\.weight \(Q2_K\)"):
        GgufConfig.verify_config(engine, SimpleNamespace(**config))
    kept = json.loads((converted["gemma3"][1] / "config.json").read_text())  # Q6_K instead of Q2_K: all kept
    GgufConfig.verify_config(engine, SimpleNamespace(**kept))


def test_phi3_long_rope_factors_become_the_config(tmp_path):
    from dataclasses import replace

    from transformers import AutoConfig

    long, short = np.linspace(1, 4, 32, dtype=np.float32), np.linspace(1, 2, 32, dtype=np.float32)
    spec = replace(SPECS["phi3"], extra={**SPECS["phi3"].extra, "rope.scaling.original_context_length": 128},
                   extra_tensors={"rope_factors_long.weight": long, "rope_factors_short.weight": short})
    path = write_tiny_gguf(tmp_path / "phi3-long-rope.gguf", spec)
    config = AutoConfig.from_pretrained(convert_gguf_to_hf_dir(path, tmp_path / "cache", progress=False))
    # Phi3Config validated the factors' count (head size / 2)
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["long_factor"] == [float(x) for x in long]
    assert config.rope_parameters["short_factor"] == [float(x) for x in short]
    assert config.original_max_position_embeddings == 128


@pytest.mark.parametrize("extra,extra_tensors,culprit", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, {}, r"RoPE scaling 'longrope'"),
    ({}, {"blk.0.attn_sinks.weight": np.zeros(4)}, r"unexpected tensor 'blk.0.attn_sinks.weight' for a qwen2"),
    ({}, {"rope_freqs.weight": np.ones(32)}, r"llama 3's scaled RoPE"),
])
def test_what_the_converter_cannot_read_is_refused_naming_it(tmp_path, extra, extra_tensors, culprit):
    arch = "llama" if "rope_freqs.weight" in extra_tensors else "qwen2"
    spec = TinySpec(arch, "gpt2", tied=True, kv_heads=4, extra=extra, extra_tensors=extra_tensors)
    path = write_tiny_gguf(tmp_path / "refused.gguf", spec)
    with pytest.raises(ModelLoadError, match=r"refused\.gguf: .*" + culprit):
        convert_gguf_to_hf_dir(path, tmp_path / "cache", progress=False)


def test_a_k_quant_qwen3_file_runs_greedy_identical_to_transformers(converted, transformers_reading):
    from asyncengine import LLM, SamplingParams

    path = converted["qwen3"][0]
    model, tokenizer = transformers_reading["qwen3"]
    prompts = ["The quick brown fox", "def square(x):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32, plugins="",
             download_dir=str(converted["qwen3"][1].parent.parent)) as llm:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            for _ in range(8):  # transformers' greedy tokens, whatever its end-of-sequence settings
                ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
        assert output.outputs[0].token_ids == ids[len(output.prompt_token_ids):], prompt
