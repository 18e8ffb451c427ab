"""GGUF mixtures of experts (loader/gguf_arch.py): a tiny random HF model of Qwen3-MoE (with a dense layer among the
sparse ones), Qwen2-MoE (a shared expert and its gate, q/k/v biases), Mixtral (a `llama` file with experts, rotary
rows permuted) and OLMoE (`olmoe`: q/k norms over the whole projection, router weights not renormalised; transformers
has no GGUF reader for it, so its tokenizer is built from the file's vocabulary alone), written as llama.cpp writes
the file (tests/support/moe_gguf.py), loads into the native class and decodes transformers' greedy tokens (top-5
logprobs within 1e-3), as the HF folder does (tests/models/test_moe_architectures.py)."""

from __future__ import annotations

import json

import pytest

from asyncengine.loader.gguf import convert_gguf_to_hf_dir
from support.moe_gguf import GGUF_ARCH, write_moe_gguf
from support.parity_runs import prompts_for, run_and_compare


@pytest.fixture(scope="module")
def references(tiny_model):
    from support.hf_reference import hf_greedy
    from support.parity_runs import NUM_TOKENS

    cache = {}

    def get(name, prompt):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy(tiny_model(name).hf_model, prompt, NUM_TOKENS)
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_a_moe_gguf_file_decodes_what_its_hf_model_decodes(tiny_model, references, make_llm, parity_record,
                                                          tmp_path, name):
    model = tiny_model(name)
    path = write_moe_gguf(model, tmp_path / f"{name}.gguf")
    converted = convert_gguf_to_hf_dir(path, tmp_path / "cache", progress=False)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == model.hf_model.config.architectures
    if name == "qwen3_moe":  # the layer without a router is the dense one
        assert config["mlp_only_layers"] == [0] and config["norm_topk_prob"] is True
    if name == "olmoe":
        assert config["norm_topk_prob"] is False and config["num_experts"] == model.hf_model.config.num_experts
    llm = make_llm(str(path), skip_tokenizer_init=True, max_model_len=256, dtype="float32",
                   download_dir=str(tmp_path / "cache"))
    assert llm.collective_rpc("describe")[0]["model_class"].startswith(f"asyncengine.models.{name}:")
    run_and_compare(llm, name, prompts_for(model.vocab_size, seed=21, lengths=(4, 37)), references, parity_record)
