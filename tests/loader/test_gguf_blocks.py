"""A GGUF file's linear weights kept as blocks (loader/gguf_blocks.py, `quantization="gguf"`): each kept type read
as `scale * q + offset` exactly as gguf's own dequantization, the default model's blocks written beside its float
checkpoint (same rows, Q/K un-permuted alike), and tensor-parallel parts taken in whole blocks."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from asyncengine.errors import ModelLoadError
from asyncengine.loader import gguf_blocks
from asyncengine.loader.gguf_blocks import BlockQuantizedRows, dequantize_blocks, split_blocks


@pytest.mark.parametrize("type_name", [t for t in gguf_blocks.KEPT_TYPES if not t.endswith("_K")])
def test_each_kept_type_reads_as_ggufs_own_dequantization(type_name):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    w[2, :32] = 0.0  # a block of zeros
    ggml_type = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, ggml_type)
    q, scale, offset = split_blocks(raw, type_name, 6, 128)
    assert q.dtype == np.int8 and scale.shape == (6, 4)
    assert (offset is not None) == type_name.endswith("_1")
    assert np.array_equal(dequantize_blocks(q, scale, offset), gguf.quants.dequantize(raw, ggml_type))
    bits = {"Q4": 4, "Q5": 5, "Q8": 8}[type_name[:2]]
    assert q.min() >= -(1 << (bits - 1)) and q.max() < (1 << (bits - 1))


def random_super_blocks(type_name: str, count: int, seed: int) -> np.ndarray:
    """Random K-quant super-blocks (any bytes are valid ones) with finite fp16 factors of either sign."""
    size, factors = {"Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    for at in factors:
        d = (rng.uniform(1e-3, 5e-2, count) * rng.choice([-1, 1], count)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("type_name", ["Q3_K", "Q4_K", "Q5_K"])
def test_k_quants_read_exactly_as_ggufs_own_dequantization(type_name):
    raw = random_super_blocks(type_name, 4 * 3, seed=11)  # 4 rows of 768 inputs
    q, scale, offset = split_blocks(raw, type_name, 4, 768)
    assert q.dtype == np.int8 and scale.shape == (4, 24) and (offset is not None) == (type_name != "Q3_K")
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(4, 768)
    assert np.array_equal(dequantize_blocks(q, scale, offset), reference)  # bit for bit


def test_q6_k_is_requantized_within_its_stated_bound():
    from asyncengine.loader.gguf_kquants import q6_k_error_bound

    raw = random_super_blocks("Q6_K", 64, seed=12)
    # One block of 32 whose halves have opposite scales of equal size and a q of -32 on the second half: the
    # one case that needs a whole step (128 clipped to 127).
    raw[0, 192:194] = np.array([100, -100], dtype=np.int8).view(np.uint8)
    raw[0, 0:32] = 0x00  # low nibbles 0 for inputs 0-31 (and 64-95) ...
    raw[0, 128:160] = 0x00  # ... and their high bits 0: q = 0 - 32 = -32 on the first 32 inputs
    q, scale, offset = split_blocks(raw, "Q6_K", 8, 2048)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(8, 2048)
    difference = np.abs(dequantize_blocks(q, scale, offset) - reference)
    step = np.repeat(q6_k_error_bound(scale), 32, axis=1)
    assert offset is None and (difference <= step * (1 + 1e-6)).all()
    assert difference[0, 16:32].max() == pytest.approx(step[0, 0])  # the clipped corner: one step
    assert (difference[0, :16] == 0).all()  # the larger scale's half: exact
    over_half = difference > step / 2 * (1 + 1e-6)  # elsewhere half a step at most, but where clipped too
    assert (q[over_half] == 127).all() and over_half.mean() < 0.01


def test_the_default_models_blocks_are_its_float_weights(default_model_dir: Path):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config[gguf_blocks.CONFIG_KEY] == {"file": "SmolLM2-135M-Instruct.Q4_1.gguf", "kept_types": ["Q4_1"],
                                              "not_kept": {}}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight"]
    with safe_open(str(default_model_dir / gguf_blocks.BLOCKS_FILE), framework="np") as blocks, \
            safe_open(str(default_model_dir / "model.safetensors"), framework="np") as floats:
        assert sum(key.endswith(".q") for key in blocks.keys()) == 30 * 7
        for name in names:  # q and k: their rows un-permuted like the float weights'
            w = dequantize_blocks(blocks.get_tensor(f"{name}.q"), blocks.get_tensor(f"{name}.scale"),
                                  blocks.get_tensor(f"{name}.offset"))
            reference = floats.get_tensor(name)
            assert np.abs(w - reference).max() <= 1e-6 * np.abs(reference).max()


def test_a_tensor_parallel_part_takes_whole_blocks():
    q = torch.arange(4 * 96, dtype=torch.int32).reshape(4, 96).remainder(7).to(torch.int8)
    scale, offset = torch.rand(4, 3), torch.rand(4, 3)
    rows = BlockQuantizedRows(q, scale, offset, "w")
    part = rows.narrow(1, 32, 64)
    assert part.shape == (4, 64) and torch.equal(part.q, q[:, 32:]) and torch.equal(part.scale, scale[:, 1:])
    assert torch.equal(rows.narrow(0, 1, 2).offset, offset[1:3])
    with pytest.raises(ModelLoadError, match="split the GGUF file's blocks"):
        rows.narrow(1, 16, 48)


def test_a_model_without_blocks_is_refused_by_the_loader(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="no GGUF blocks"):
        list(gguf_blocks.with_blocks(iter([("x", torch.zeros(1))]), tmp_path))


def test_the_k_quant_readers_use_the_kept_block_size():
    from asyncengine.loader import gguf_kquants

    assert gguf_kquants.BLOCK == gguf_blocks.BLOCK == 32
