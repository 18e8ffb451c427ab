"""The transformers backend (model_impl, asyncengine/models/transformers_backend.py) against transformers itself.

- Cohere, which has no native class here, falls back to transformers' modelling code on its own (model_impl auto,
  said in the log): 8 requests of different prompt lengths and lengths of output, four at a time (requests join
  as others finish), a small token budget (long prompts prefill in chunks, beside others' decodes), run twice
  (the second run hits the prefix cache), give transformers' greedy tokens and top-5 logprobs within 1e-3.
- A checkpoint that ships its own modelling code (written by the test) runs it with trust_remote_code, and is
  refused without.
- Llama forced through transformers (model_impl transformers) gives the native class's tokens.
- model_impl native refuses an architecture without a native class, naming it; more than one rank is refused.
"""

from __future__ import annotations

import json
import logging
import random
import textwrap

import pytest

from asyncengine import SamplingParams
from asyncengine.errors import ConfigError, UnsupportedArchitectureError
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import check_greedy, hf_greedy
from support.tiny_models import random_causal_lm

PROMPT_LENGTHS = (3, 40, 17, 64, 5, 29, 11, 50)
OUTPUT_LENGTHS = (24, 9, 16, 24, 5, 20, 12, 7)
ENGINE = dict(skip_tokenizer_init=True, max_model_len=256, dtype="float32", kv_cache_memory_bytes=2**22)


BACKEND = "asyncengine.models.transformers_backend:TransformersForCausalLM"


def model_class(llm) -> str:
    """The class the worker built the model from."""
    return llm.collective_rpc("describe")[0]["model_class"]


def prompts_for(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def cohere(tmp_path_factory):
    """A tiny Cohere: parallel attention and MLP, LayerNorm, q/k norms, GQA, tied embeddings, a logit scale."""
    import transformers

    config = transformers.CohereConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1009, max_position_embeddings=256, initializer_range=0.2, logit_scale=0.5, use_qk_norm=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    model = random_causal_lm(config, seed=3)
    path = tmp_path_factory.mktemp("tiny-cohere")
    model.save_pretrained(path)
    return path, model


def generate_and_compare(llm, prompts, hf_model, parity_record):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5) for n in OUTPUT_LENGTHS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output, num_tokens in zip(prompts, outputs, OUTPUT_LENGTHS):
        assert output.finished and len(output.outputs[0].token_ids) == num_tokens
        check_greedy(output.outputs[0], hf_greedy(hf_model, prompt, num_tokens), parity_record)
    assert_all_blocks_free(llm.get_scheduler_stats())
    return outputs


def test_an_architecture_without_a_native_class_runs_through_transformers(cohere, make_llm, parity_record, caplog):
    path, hf_model = cohere
    with caplog.at_level(logging.WARNING, logger="asyncengine.config.model"):
        llm = make_llm(str(path), max_num_seqs=4, max_num_batched_tokens=32, block_size=8, **ENGINE)
    assert any("CohereForCausalLM have no native implementation" in r.getMessage() and "transformers" in r.getMessage()
               for r in caplog.records)
    assert model_class(llm) == BACKEND
    prompts = prompts_for(1009, seed=1)
    first = generate_and_compare(llm, prompts, hf_model, parity_record)
    second = generate_and_compare(llm, prompts, hf_model, parity_record)
    assert sum(o.num_cached_tokens for o in first) < sum(o.num_cached_tokens for o in second)
    assert all(o.num_cached_tokens >= (len(p) - 1) // 8 * 8 for p, o in zip(prompts, second))


def test_model_impl_native_refuses_it_naming_the_architecture(cohere, make_llm):
    with pytest.raises(UnsupportedArchitectureError, match="CohereForCausalLM.*model_impl is native"):
        make_llm(str(cohere[0]), model_impl="native", **ENGINE)


def test_more_than_one_rank_is_refused(cohere, make_llm):
    with pytest.raises(ConfigError, match="one rank: tensor_parallel_size"):
        make_llm(str(cohere[0]), tensor_parallel_size=2, **ENGINE)


def test_forced_transformers_on_llama_equals_native(tiny_model, make_llm, parity_record):
    model = tiny_model("llama")
    prompts = prompts_for(model.vocab_size, seed=2)
    tokens = {}
    for impl in ("native", "transformers"):
        llm = make_llm(str(model.path), model_impl=impl, **ENGINE)
        assert model_class(llm) == (BACKEND if impl == "transformers" else "asyncengine.models.llama:LlamaForCausalLM")
        outputs = generate_and_compare(llm, prompts, model.hf_model, parity_record)
        tokens[impl] = [o.outputs[0].token_ids for o in outputs]
        llm.close()  # one engine at a time
    assert tokens["transformers"] == tokens["native"]


REMOTE_CONFIG = '''
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''

REMOTE_MODEL = '''
import torch
from transformers import LlamaForCausalLM, LlamaModel

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteModel(LlamaModel):
    config_class = TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    """Llama whose MLP output is halved: code transformers does not have, so only the files' own code is right."""

    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyRemoteModel(config)
        for layer in self.model.layers:
            layer.mlp.register_forward_hook(lambda module, args, output: output * 0.5)
        self.post_init()
'''


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory):
    """A checkpoint with its own configuration and modelling code (auto_map), and transformers' run of it."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-remote")
    (path / "configuration_tiny_remote.py").write_text(textwrap.dedent(REMOTE_CONFIG))
    (path / "modeling_tiny_remote.py").write_text(textwrap.dedent(REMOTE_MODEL))
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1013, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager")
    random_causal_lm(config, seed=5).save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                          "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(data))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype="float32",
                                                                  attn_implementation="eager").eval()
    return path, reference


def test_a_checkpoints_own_modelling_code_runs_with_trust_remote_code(remote_code_model, make_llm, parity_record):
    path, reference = remote_code_model
    with pytest.raises(UnsupportedArchitectureError, match="trust_remote_code"):
        make_llm(str(path), **ENGINE)
    llm = make_llm(str(path), trust_remote_code=True, **ENGINE)
    generate_and_compare(llm, prompts_for(1013, seed=4), reference, parity_record)
