"""GPT-OSS's MXFP4 experts dequantized on load (asyncengine/models/gpt_oss.py): the E2M1 blocks and their
power-of-two scales decode to what transformers' own MXFP4 dequantization gives, and a checkpoint whose experts
are stored as MXFP4 (`*_blocks`, `*_scales`, in either order) loads into the same parameters as the same
experts stored unquantized; a block without its scales is refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from asyncengine.errors import ModelLoadError
from asyncengine.models.gpt_oss import GptOssForCausalLM, dequantize_mxfp4

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 blocks `[*shape, 16]` (every code, both nibbles) and scales `shape` around 2**0 (127 +- 4)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(123, 132, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantization_matches_transformers():
    blocks, scales = random_mxfp4((3, 10, 4), seed=0)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    # transformers returns the matrix transposed for its forward ([E, G*32, rows]); ours is the rows' values.
    assert torch.equal(ours, theirs.transpose(1, 2))


def _model(tiny_model) -> tuple[GptOssForCausalLM, dict[str, torch.Tensor], SimpleNamespace]:
    model = tiny_model("gpt_oss")
    config = SimpleNamespace(**json.loads((model.path / "config.json").read_text()))
    return (GptOssForCausalLM(config, dtype=torch.float32, max_position=256),
            load_file(str(model.path / "model.safetensors")), config)


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_experts(tiny_model):
    unquantized, tensors, config = _model(tiny_model)
    quantized, _, _ = _model(tiny_model)
    hidden, inner, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    as_mxfp4, as_float = {}, {}
    for layer in range(config.num_hidden_layers):
        for seed, (proj, rows, columns) in enumerate((("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner))):
            blocks, scales = random_mxfp4((experts, rows, columns // 32), seed=10 * layer + seed)
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            # Scales first on one projection, blocks first on the other: the pair waits for its other half.
            as_mxfp4.update({f"{name}_scales": scales, f"{name}_blocks": blocks} if seed else
                            {f"{name}_blocks": blocks, f"{name}_scales": scales})
            as_float[name] = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    rest = {name: tensor for name, tensor in tensors.items() if name not in as_float}
    unquantized.load_weights({**rest, **as_float}.items())
    quantized.load_weights({**rest, **as_mxfp4}.items())
    theirs = dict(unquantized.named_parameters())
    for name, param in quantized.named_parameters():
        assert torch.equal(param, theirs[name]), name
    assert theirs["model.layers.0.mlp.experts.w13_weight"].abs().max() > 0  # really loaded


def test_blocks_without_scales_are_refused(tiny_model):
    model, tensors, config = _model(tiny_model)
    blocks, _ = random_mxfp4((config.num_local_experts, config.hidden_size, config.intermediate_size // 32), seed=1)
    tensors = {name: t for name, t in tensors.items() if not name.endswith("mlp.experts.down_proj")}
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = blocks
    with pytest.raises(ModelLoadError, match="without their pair: .*layers.0.mlp.experts.down_proj"):
        model.load_weights(tensors.items())
