"""The adapter pool and the checks, on one in-process engine (tiny Llama): 50 adapters through 4 slots leave the
pool at the size max_loras says and every KV block free; refused adapters fail naming the field. Adapters are
written directly in PEFT's file format here (random matrices): the parity module proves the format is peft's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import RequestError, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.interfaces.lora_resolver import LoRARequest
from support.lora_adapters import TINY_LLAMA_SHAPES as SHAPES
from support.lora_adapters import write_adapter

pytestmark = pytest.mark.timeout(300)

MAX_LORAS, MAX_RANK = 4, 8


@pytest.fixture(scope="module")
def llm(tiny_model):
    from asyncengine import LLM

    made = LLM(str(tiny_model("llama").path), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
               max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, max_model_len=64, num_gpu_blocks_override=32)
    yield made
    made.close()


PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


def _slot_bytes() -> int:
    """One slot of every wrapped layer, float32: A is [S*R, in], B [S*R, out], S projections fused."""
    fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
             "down": ("down_proj",)}
    per_layer = 0
    for projections in fused.values():
        width = len(projections) * MAX_RANK
        in_features = SHAPES[projections[0]][0]
        out_features = sum(SHAPES[p][1] for p in projections)
        per_layer += width * (in_features + out_features)
    return 2 * per_layer * 4


def test_fifty_adapters_through_four_slots_leave_nothing_behind(llm, tmp_path):
    before = llm.collective_rpc("lora_info")[0]
    assert before["pool_bytes"] == MAX_LORAS * _slot_bytes()
    loras = [LoRARequest(f"many-{i}", 100 + i, str(write_adapter(tmp_path / f"a{i}", seed=i))) for i in range(50)]
    outputs = llm.generate([PROMPT] * 50, PARAMS, lora_request=loras)
    assert all(len(out.outputs[0].token_ids) == 3 for out in outputs)
    assert len({tuple(out.outputs[0].token_ids) for out in outputs}) > 10  # the adapters did apply
    after = llm.collective_rpc("lora_info")[0]
    assert after["pool_bytes"] == before["pool_bytes"] == MAX_LORAS * _slot_bytes()
    assert after["slot_loads"] - before["slot_loads"] == 50
    assert len(after["cpu_cache"]) <= MAX_LORAS  # max_cpu_loras defaults to max_loras
    stats = llm.get_scheduler_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_an_adapter_with_modules_to_save_is_refused_naming_the_field(llm, tmp_path):
    path = write_adapter(tmp_path / "mts", modules_to_save=["lm_head"])
    with pytest.raises(RequestError, match="modules_to_save") as caught:
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("mts", 900, str(path)))
    assert caught.value.field == "lora_request.modules_to_save"


def test_a_rank_above_max_lora_rank_is_refused_naming_both(llm, tmp_path):
    path = write_adapter(tmp_path / "big", rank=MAX_RANK * 2)
    with pytest.raises(RequestError, match=r"r=16 exceeds max_lora_rank=8"):
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("big", 901, str(path)))


def test_extra_vocabulary_is_refused(llm, tmp_path):
    path = write_adapter(tmp_path / "vocab")
    save_file({"x": torch.zeros(1)}, str(path / "new_embeddings.safetensors"))
    with pytest.raises(RequestError, match="extra vocabulary"):
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("vocab", 902, str(path)))


def test_an_adapter_for_another_base_model_fails_only_its_request(llm, tmp_path):
    wrong = dict(SHAPES, q_proj=(64, 64))
    path = write_adapter(tmp_path / "other-base", shapes=wrong)
    with pytest.raises(RequestError, match=r"LoRA adapter 'other-base' \(.*\): layer 0 q_proj: lora_A \(4, 64\) and "
                       r"lora_B \(64, 4\) do not fit this model \(.*\), which needs lora_A \(4, 96\) and lora_B "
                       r"\(96, 4\) at r=4: load an adapter trained for this base model"):
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("other-base", 903, str(path)))
    assert llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids  # the engine goes on


def test_an_adapter_for_a_layer_the_model_lacks_is_refused_naming_it(llm, tmp_path):
    path = write_adapter(tmp_path / "deeper")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({name.replace("layers.1.", "layers.7."): tensor for name, tensor in tensors.items()},
              str(path / "adapter_model.safetensors"))
    with pytest.raises(RequestError, match=r"layer 7 q_proj is not a layer of this model \(.*\), which has LoRA "
                       r"layers 0-1 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("deeper", 905, str(path)))


def test_the_workers_load_check_reads_shapes_only_and_takes_no_slot(llm, tmp_path):
    """What the frontend asks before it registers a name (POST /v1/load_lora_adapter, a resolver's answer)."""
    good = write_adapter(tmp_path / "fits", seed=5)
    wrong = write_adapter(tmp_path / "misfit", shapes=dict(SHAPES, down_proj=(96, 96)), targets=("down_proj",))
    before = llm.collective_rpc("lora_info")[0]
    assert llm.collective_rpc("check_lora_adapter", args=["fits", str(good)]) == [None]
    [refused] = llm.collective_rpc("check_lora_adapter", args=["misfit", str(wrong)])
    assert refused["field"] == "lora_path"
    assert "layer 0 down_proj: lora_A (4, 96) and lora_B (96, 4) do not fit" in refused["message"]
    assert "needs lora_A (4, 160) and lora_B (96, 4)" in refused["message"]
    assert llm.collective_rpc("lora_info")[0] == before  # no slot loaded, nothing cached


def test_lora_modules_with_an_adapter_that_does_not_fit_fail_start_up(tiny_model, tmp_path):
    from asyncengine import LLM

    path = write_adapter(tmp_path / "other-base", shapes=dict(SHAPES, v_proj=(96, 48)))
    with pytest.raises(ConfigError, match=r"lora_modules other-base: LoRA adapter 'other-base' .* layer 0 v_proj: "
                       r"lora_A \(4, 96\) and lora_B \(48, 4\) do not fit") as caught:
        LLM(str(tiny_model("llama").path), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
            lora_modules=[f"other-base={path}"], max_model_len=64, num_gpu_blocks_override=8)
    assert caught.value.field == "lora_modules"


def test_one_id_for_two_directories_is_refused(llm, tmp_path):
    first = write_adapter(tmp_path / "one", seed=1)
    second = write_adapter(tmp_path / "two", seed=2)
    llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("one", 904, str(first)))
    with pytest.raises(RequestError, match="lora_int_id 904 already names"):
        llm.generate(PROMPT, PARAMS, lora_request=LoRARequest("two", 904, str(second)))


def test_lora_requests_need_enable_lora(tiny_model, make_llm, tmp_path):
    path = write_adapter(tmp_path / "off")
    plain = make_llm(str(tiny_model("llama").path), skip_tokenizer_init=True, max_model_len=64,
                     num_gpu_blocks_override=8)
    with pytest.raises(RequestError, match="enable_lora"):
        plain.generate(PROMPT, PARAMS, lora_request=LoRARequest("off", 1, str(path)))
