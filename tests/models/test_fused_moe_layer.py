"""The FusedMoE layer (asyncengine/models/layers/fused_moe.py): with each architecture's settings it computes what
transformers' own MoE block computes (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE with its gated shared expert,
GPT-OSS with its biases and clamped swiglu), on the CPU kernel and on the reference; it runs a provider
registered for op "fused_moe" instead of its CPU kernel; it loads experts from per-expert and stacked tensors.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers

from support.op_tables import private_op_tables
from support.torch_threads import one_torch_thread

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers import op_registry
from asyncengine.models.layers.fused_moe import FusedMoE
from asyncengine.models.layers.op_registry import register_op_impl
from asyncengine.ops import cpu_moe
from asyncengine.ops.fused_moe import MoeConfig, fused_moe_reference

SIZE, INNER, EXPERTS, TOP_K = 64, 32, 8, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def tables(monkeypatch):
    private_op_tables(monkeypatch)


def _config(name: str, **extra):
    common = dict(hidden_size=SIZE, num_experts_per_tok=TOP_K, hidden_act="silu")
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(intermediate_size=INNER, num_local_experts=EXPERTS, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(moe_intermediate_size=INNER, num_experts=EXPERTS,
                                                         norm_topk_prob=True, **common),
        "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=INNER, num_experts=EXPERTS, **common),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(moe_intermediate_size=INNER, num_experts=EXPERTS,
                                                         shared_expert_intermediate_size=48, **common),
        "gpt_oss": lambda: transformers.GptOssConfig(intermediate_size=INNER, num_local_experts=EXPERTS,
                                                     swiglu_limit=1.5, **common),
    }
    config = configs[name]()
    config._experts_implementation = "eager"
    return config


BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock",
          "qwen2_moe": "Qwen2MoeSparseMoeBlock", "gpt_oss": "GptOssMLP"}


def _hf_block(name: str, config):
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    block = getattr(module, BLOCKS[name])(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block.eval()


def _ours(name: str, config, block) -> tuple[FusedMoE, torch.nn.Module]:
    """(our layer with the architecture's settings and the block's weights, the router)."""
    if name == "gpt_oss":
        layer = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32, routing="topk_softmax",
                         activation="swigluoai", has_bias=True, swiglu_alpha=config.swiglu_alpha,
                         swiglu_limit=config.swiglu_limit)
        experts = block.experts  # gate_up_proj [E, H, 2I] with gate and up interleaved; down_proj [E, I, H]
        gate_up = experts.gate_up_proj.transpose(1, 2)
        layer.load_stacked(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1), param="w13_weight", name="gate_up")
        bias = experts.gate_up_proj_bias
        layer.load_stacked(torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1), param="w13_bias", name="gate_up_bias")
        layer.load_stacked(experts.down_proj.transpose(1, 2), param="w2_weight", name="down")
        layer.load_stacked(experts.down_proj_bias, param="w2_bias", name="down_bias")
        return layer, block.router
    shared = dict(shared_expert=block.shared_expert, shared_expert_gate=block.shared_expert_gate) \
        if name == "qwen2_moe" else {}
    renormalize = True if name == "mixtral" else config.norm_topk_prob
    layer = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32, renormalize=renormalize, **shared)
    layer.load_stacked(block.experts.gate_up_proj.data, param="w13_weight", name="gate_up_proj")
    layer.load_stacked(block.experts.down_proj.data, param="w2_weight", name="down_proj")
    return layer, block.gate


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
def test_the_layer_computes_what_transformers_block_computes(name):
    config = _config(name)
    block = _hf_block(name, config)
    layer, router = _ours(name, config, block)
    hidden = torch.randn(1, 23, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(hidden)
        want = (want[0] if isinstance(want, tuple) else want).reshape(23, SIZE)
        flat = hidden.reshape(23, SIZE)
        logits = F.linear(flat, router.weight, getattr(router, "bias", None))
        assert layer.dispatch_forward() == "forward_cpu"
        on_cpu_kernel = layer(flat, logits)
        on_reference = layer.forward_native(flat, logits)
    scale = float(want.abs().max())
    assert float((on_cpu_kernel - want).abs().max()) <= 1e-5 * scale
    assert float((on_reference - want).abs().max()) <= 1e-5 * scale


def test_a_registered_provider_runs_instead_of_the_cpu_kernel(monkeypatch):
    calls = []

    def counting(*args):
        calls.append(args[0].shape[0])
        return fused_moe_reference(*args)

    layer = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32)
    for param in layer.parameters():
        param.data.normal_(0, 0.3)
    ran_cpu_kernel = []
    real = cpu_moe.fused_moe_cpu
    monkeypatch.setattr(cpu_moe, "fused_moe_cpu",
                        lambda *args, **kwargs: ran_cpu_kernel.append(1) or real(*args, **kwargs))
    hidden, logits = torch.randn(5, SIZE), torch.randn(5, EXPERTS)
    plain = layer(hidden, logits)
    assert ran_cpu_kernel == [1] and calls == []
    chosen = torch.bincount(torch.topk(logits, TOP_K).indices.reshape(-1), minlength=EXPERTS)
    assert torch.equal(layer.expert_tokens, chosen)  # counted by the kernel
    register_op_impl("fused_moe", "counting", counting)
    with_provider = layer(hidden, logits)
    assert calls == [5] and ran_cpu_kernel == [1]
    assert torch.equal(layer.expert_tokens, 2 * chosen)  # counted by the layer around the provider
    assert torch.allclose(with_provider, plain, atol=1e-5)
    assert op_registry.provider_order("fused_moe")[0] == ["counting", "native"]  # triton is left out on CPU


def test_the_reordered_experts_follow_a_replaced_weight_and_are_reordered_again_when_asked():
    layer = FusedMoE(4, 2, SIZE, INNER, dtype=torch.bfloat16)
    for param in layer.parameters():
        param.data.normal_(0, 0.3)
    hidden, logits = torch.randn(3, SIZE).to(torch.bfloat16), torch.randn(3, 4)
    before = layer(hidden, logits)
    layer.w2_weight.data = layer.w2_weight.data * 2  # a new tensor: seen at the next call
    assert torch.equal(layer(hidden, logits), layer.forward_native(hidden, logits))
    assert not torch.equal(layer(hidden, logits), before)
    layer.w2_weight.data.mul_(0.5)  # in place: seen once the layer is told
    layer.forget_reordered_experts()
    assert torch.equal(layer(hidden, logits), before)


def test_per_expert_checkpoint_tensors_load_into_the_stacked_parameters():
    layer = FusedMoE(3, 1, 8, 4, dtype=torch.float32, has_bias=True)
    gate, up, down = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4)
    layer.load_expert(gate, expert=2, shard="w1", name="experts.2.w1.weight")
    layer.load_expert(up, expert=2, shard="up_proj", name="experts.2.up_proj.weight")
    layer.load_expert(down, expert=2, shard="down", name="experts.2.down.weight")
    layer.load_expert(torch.arange(4.0), expert=2, shard="up", name="experts.2.up.bias", bias=True)
    layer.load_expert(torch.ones(8), expert=2, shard="w2", name="experts.2.w2.bias", bias=True)
    assert torch.equal(layer.w13_weight[2], torch.cat([gate, up])) and torch.equal(layer.w2_weight[2], down)
    assert torch.equal(layer.w13_bias[2, 4:], torch.arange(4.0)) and torch.equal(layer.w2_bias[2], torch.ones(8))
    with pytest.raises(ModelLoadError, match="has shape"):
        layer.load_expert(torch.randn(5, 8), expert=0, shard="gate", name="experts.0.gate_proj.weight")
    with pytest.raises(ModelLoadError, match="expert 3 of a layer with 3 experts"):
        layer.load_expert(gate, expert=3, shard="gate", name="experts.3.gate_proj.weight")
    with pytest.raises(ModelLoadError, match="unknown expert projection 'w4'"):
        layer.load_expert(gate, expert=0, shard="w4", name="experts.0.w4.weight")
    with pytest.raises(ModelLoadError, match="built without biases"):
        FusedMoE(3, 1, 8, 4, dtype=torch.float32).load_expert(torch.ones(8), expert=0, shard="down", name="b",
                                                              bias=True)


def test_scaling_and_a_shared_expert_without_a_gate_are_added_as_deepseek_does():
    shared = torch.nn.Linear(SIZE, SIZE, bias=False)
    layer = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32, shared_expert=shared,
                     routed_scaling_factor=2.5)
    for param in layer.parameters():
        param.data.normal_(0, 0.3)
    hidden, logits = torch.randn(4, SIZE), torch.randn(4, EXPERTS)
    with torch.no_grad():
        routed = fused_moe_reference(hidden, logits, layer.w13_weight, layer.w2_weight, None, None, layer.config)
        assert torch.allclose(layer(hidden, logits), 2.5 * routed + shared(hidden), atol=1e-5)


def test_a_ported_plugins_fused_moe_replacement_is_built_in_its_place(monkeypatch):
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "worker rank 0")
    from asyncengine.plugins_api import FusedMoE as ExportedFusedMoE
    from asyncengine.porting.codemod import port_python

    assert ExportedFusedMoE is FusedMoE
    assert "from asyncengine.plugins_api import FusedMoE" in port_python(
        "from vllm.model_executor.layers.fused_moe import FusedMoE\n").text

    @FusedMoE.register_oot
    class PluginFusedMoE(FusedMoE):  # vLLM's form: registered under the in-tree op's name
        def forward_oot(self, hidden, router_logits):
            return super().forward_oot(hidden, router_logits)

    built = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32)
    assert type(built) is PluginFusedMoE and built.w13_weight.shape == (EXPERTS, 2 * INNER, SIZE)
    assert "custom op:FusedMoE" in {r.plugin for r in op_registry.startup_records("load model")}


def test_the_triton_provider_is_registered_and_left_out_where_it_cannot_run():
    from asyncengine.interfaces.imports import import_by_path
    from asyncengine.ops import triton_moe

    entry = op_registry.OpProviderRegistry.registered("fused_moe/triton")
    assert import_by_path(entry.implementation, what="fused_moe/triton") is triton_moe.fused_moe_triton
    assert op_registry.providers_of("fused_moe") == ["native", "triton"]
    if not op_registry.triton_runs_here():
        assert op_registry.provider_order("fused_moe")[0] == ["native"]
    cpu_args = (torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(4, 8, 8), torch.zeros(4, 8, 4), None, None,
                MoeConfig(2))
    assert not op_registry._options["fused_moe/triton"].supported(*cpu_args)  # CPU tensors: the next provider


def test_tensor_parallel_ranks_hold_slices_of_every_expert_and_their_sum_is_the_whole(monkeypatch):
    from asyncengine import parallel_state as parallel

    generator = torch.Generator().manual_seed(3)
    gate_up = torch.randn(EXPERTS, 2 * INNER, SIZE, generator=generator) * 0.2
    down = torch.randn(EXPERTS, SIZE, INNER, generator=generator) * 0.2
    biases = torch.randn(EXPERTS, 2 * INNER, generator=generator), torch.randn(EXPERTS, SIZE, generator=generator)
    hidden, logits = torch.randn(6, SIZE, generator=generator), torch.randn(6, EXPERTS, generator=generator)

    def built(rank: int, ranks: int) -> FusedMoE:
        monkeypatch.setattr(parallel, "rank", lambda: rank)
        monkeypatch.setattr(parallel, "world_size", lambda: ranks)
        layer = FusedMoE(EXPERTS, TOP_K, SIZE, INNER, dtype=torch.float32, has_bias=True, reduce_results=False)
        for param, tensor in (("w13_weight", gate_up), ("w2_weight", down), ("w13_bias", biases[0]),
                              ("w2_bias", biases[1])):
            layer.load_stacked(tensor, param=param, name=param)
        return layer

    with torch.no_grad():
        whole = built(0, 1)(hidden, logits)
        parts = []
        for rank in (0, 1):
            layer = built(rank, 2)
            assert layer.w13_weight.shape == (EXPERTS, INNER, SIZE)  # half of gate's rows, half of up's
            assert torch.equal(layer.w13_weight[:, INNER // 2:], gate_up[:, INNER + rank * INNER // 2:][:, :INNER // 2])
            parts.append(layer(hidden, logits))  # (rank 1 leaves the down bias out: the sum adds it once)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-4)
