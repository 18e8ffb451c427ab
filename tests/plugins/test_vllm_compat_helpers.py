"""vLLM's helpers that public plugins import, in-process (asyncengine/compat: torch_utils, weight_utils,
compilation, utils), each with vLLM's behaviour: the custom op a plugin registers is callable as vLLM's are
(torch.ops.vllm.NAME), the loader helpers read and filter checkpoints as vLLM's do, a wrong shape is an error
naming both shapes, CUDA's stream is refused where there is no CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from asyncengine.compat.compilation import CompilationLevel, CompilationMode, CUDAGraphMode
from asyncengine.compat.torch_utils import current_stream, direct_register_custom_op, set_default_torch_dtype
from asyncengine.compat.utils import is_pooling_model
from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.linear import default_weight_loader
from asyncengine.compat.weight_utils import (
    filter_duplicate_safetensors_files,
    filter_files_not_needed_for_inference,
    pt_weights_iterator,
    safetensors_weights_iterator,
)


def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


def scaled_add_fake(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_registered_custom_op_is_called_as_vllms_are():
    direct_register_custom_op("ae_test_scaled_add", scaled_add, fake_impl=scaled_add_fake)
    x, y = torch.ones(3), torch.arange(3.0)
    assert torch.equal(torch.ops.vllm.ae_test_scaled_add(x, y, 2.0), x + 2.0 * y)
    with pytest.raises(RuntimeError):  # a name is registered once, as in vLLM
        direct_register_custom_op("ae_test_scaled_add", scaled_add)


def test_the_default_dtype_is_set_inside_the_block_only():
    before = torch.get_default_dtype()
    with set_default_torch_dtype(torch.bfloat16):
        assert torch.empty(1).dtype == torch.bfloat16
    assert torch.get_default_dtype() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_current_stream_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        current_stream()


def test_the_loader_helpers_read_and_filter_checkpoints_as_vllms_do(tmp_path):
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.full((1,), 7.0)}, tmp_path / "model-2.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "consolidated.safetensors")
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    (tmp_path / "index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors",
                                                                     "b": "model-1.safetensors",
                                                                     "c": "model-2.safetensors"}}))
    kept = filter_duplicate_safetensors_files(files, str(tmp_path), "index.json")
    assert [p.rsplit("/", 1)[1] for p in kept] == ["model-1.safetensors", "model-2.safetensors"]
    assert filter_duplicate_safetensors_files(files, str(tmp_path), "absent.json") == files
    assert [name for name, _ in safetensors_weights_iterator(kept, True)] == ["a", "b", "c"]
    torch.save({"d": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    assert [name for name, _ in pt_weights_iterator([str(tmp_path / "pytorch_model.bin")])] == ["d"]
    assert filter_files_not_needed_for_inference(["w.bin", "training_args.bin", "optimizer.pt"]) == ["w.bin"]


def test_default_weight_loader_copies_whole_and_names_a_wrong_shape():
    param = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    default_weight_loader(param, torch.ones(2, 3))
    assert torch.equal(param.data, torch.ones(2, 3))
    scalar = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    default_weight_loader(scalar, torch.tensor(4.0))  # a scalar into a one-element parameter
    assert scalar.item() == 4.0
    with pytest.raises(ModelLoadError, match=r"has shape \(3, 2\), but the model built from config.json expects \(2, 3\)"):
        default_weight_loader(param, torch.ones(3, 2))


def test_vllms_enums_and_predicates():
    assert (CompilationMode.NONE, CompilationLevel.NO_COMPILATION) == (0, 0)
    assert CUDAGraphMode.FULL_AND_PIECEWISE.value == (CUDAGraphMode.FULL.value, CUDAGraphMode.PIECEWISE.value)
    assert is_pooling_model(type("Embedder", (), {"is_pooling_model": True})) and not is_pooling_model(object())
