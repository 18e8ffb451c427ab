"""The family's tokenizer mode and weight format, without an engine (asyncengine's
tests/e2e/test_extension_point_rows.py runs them in one, each in the process that must run it)."""

from __future__ import annotations

import numpy as np
import pytest

from ae_model_example.loader import WEIGHTS_FILE, save_npz
from ae_model_example.tokenizer import ExampleByteTokenizer


def test_bytes_round_trip_with_and_without_special_tokens():
    tokenizer = ExampleByteTokenizer.from_pretrained("unused")
    ids = tokenizer.encode("caf\u00e9 \u2603")
    assert ids[0] == tokenizer.bos_token_id and all(3 <= i < 259 for i in ids[1:])
    assert tokenizer.decode(ids, skip_special_tokens=True) == "caf\u00e9 \u2603"
    assert tokenizer.decode(ids) == "<1>caf\u00e9 \u2603"
    assert tokenizer.encode("ab", add_special_tokens=False) == [ord("a") + 3, ord("b") + 3]


def test_a_cut_character_decodes_to_the_replacement_character_the_detokenizer_holds_back():
    tokenizer = ExampleByteTokenizer()
    ids = tokenizer.encode("\u00e9", add_special_tokens=False)
    assert len(ids) == 2 and tokenizer.decode(ids[:1]) == "\ufffd"


def test_save_npz_keeps_every_tensor(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "b.bias": np.ones(4, dtype=np.float16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    target = save_npz(tmp_path)
    assert target == tmp_path / WEIGHTS_FILE
    with np.load(target) as archive:
        assert sorted(archive.files) == sorted(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(archive[name], value)


def test_save_npz_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no \\*.safetensors file"):
        save_npz(tmp_path)
