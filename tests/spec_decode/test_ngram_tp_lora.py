"""Speculation with tensor parallelism and with a LoRA target (issue 37, acceptance 1), on n-gram, the
representative proposer: greedy tokens equal transformers' (TP=2 sums partial products in another order, hence the
tie rule) and peft's for each adapter, with drafts accepted and rejected on the way.

The target is the tiny Llama with every attention output projection zeroed: its next token then depends on the
current token only, so greedy decoding falls into a cycle that n-gram lookup drafts in full once it has seen it
(on a plain random model almost every draft is rejected, which checks only half of verification). Adapters
touch the MLP only, so they keep that property while changing the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import LLM, SamplingParams
from asyncengine.interfaces.lora_resolver import LoRARequest
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import compare_greedy, hf_greedy
from support.lora_adapters import make_adapter
from support.tiny_models import TinyModel

pytestmark = pytest.mark.timeout(300)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NUM_TOKENS = 32
PROMPTS = [[5, 6, 7, 8] * 3, [3, 9, 14, 2, 77], list(range(40, 52))]
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cycling(tiny_model, tmp_path_factory) -> TinyModel:
    """The tiny Llama without attention output: a token-to-token map, whose greedy runs cycle."""
    import transformers

    base = tiny_model("llama")
    directory = tmp_path_factory.mktemp("cycling-llama")
    for item in base.path.iterdir():
        if item.suffix != ".safetensors":
            (directory / item.name).write_bytes(item.read_bytes())
    for weights in base.path.glob("*.safetensors"):
        tensors = load_file(str(weights))
        save_file({name: torch.zeros_like(t) if name.endswith("o_proj.weight") else t
                   for name, t in tensors.items()}, str(directory / weights.name), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return TinyModel("cycling-llama", Path(directory), hf, base.vocab_size)


@pytest.fixture(scope="module")
def prompts(cycling) -> list[list[int]]:
    """PROMPTS and one that misleads the lookup: it starts with the token the model will answer its last token
    with, followed by a token the model would not choose, so the first drafts (read from the prompt's start)
    are rejected."""
    first = hf_greedy(cycling.hf_model, [10], 1).token_ids[0]
    wrong = (hf_greedy(cycling.hf_model, [first], 1).token_ids[0] + 1) % cycling.vocab_size
    return PROMPTS + [[first, wrong, 30, 40, 10]]


def check_against(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> None:
    compare_greedy(tokens, None, hf_greedy(model, prompt, NUM_TOKENS))


def assert_drafts_accepted_and_rejected(stats) -> None:
    assert stats.spec_decode_num_accepted_tokens > 0, "the cycles were meant to be drafted and accepted"
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, \
        "the misleading prompt's drafts were meant to be rejected"


def test_tensor_parallel_verification_gives_transformers_tokens(cycling, prompts):
    with LLM(str(cycling.path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, tensor_parallel_size=2,
             speculative_config=NGRAM) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        stats = llm.get_scheduler_stats()
        assert_drafts_accepted_and_rejected(stats)
        assert_all_blocks_free(stats)
    for prompt, output in zip(prompts, outputs, strict=True):
        check_against(cycling.hf_model, prompt, list(output.outputs[0].token_ids))


def test_a_lora_target_verifies_with_each_requests_adapter(cycling, prompts, peft, tmp_path_factory):
    root = tmp_path_factory.mktemp("cycling-adapters")
    mlp = ["gate_proj", "up_proj", "down_proj"]
    adapters = [make_adapter(peft, cycling.path, root / f"mlp-{seed}", name=f"mlp-{seed}", rank=4, targets=mlp,
                             seed=seed) for seed in (1, 2)]
    jobs = [(prompt, index) for index in (None, 0, 1) for prompt in prompts]
    loras = [None if index is None else LoRARequest(adapters[index].name, index + 1, str(adapters[index].path))
             for _, index in jobs]
    with LLM(str(cycling.path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, enable_lora=True,
             max_loras=2, max_lora_rank=4, speculative_config=NGRAM) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], PARAMS, lora_request=loras)
        stats = llm.get_scheduler_stats()
        assert_drafts_accepted_and_rejected(stats)
        assert_all_blocks_free(stats)
    for (prompt, index), output in zip(jobs, outputs, strict=True):
        reference = cycling.hf_model if index is None else adapters[index].reference
        check_against(reference, prompt, list(output.outputs[0].token_ids))
    # The adapters change the tokens (else this would check little).
    by_adapter = {index: tuple(o.outputs[0].token_ids) for (p, index), o in zip(jobs, outputs) if p == PROMPTS[1]}
    assert len(set(by_adapter.values())) == 3
