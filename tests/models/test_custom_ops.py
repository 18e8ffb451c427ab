"""Custom ops (EXTENSION_POINTS.md, R2): per-platform dispatch, out-of-tree replacement by name, op
providers chosen per call by priority and by what they support, and the worker's start-up records.

Registrations are process-wide, so every test here runs on copies of the tables (`tables`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.op_tables import private_op_tables

from asyncengine.errors import ConfigError
from asyncengine.models.layers import op_registry
from asyncengine.models.layers.activation import SiluAndMul, silu_and_mul_native
from asyncengine.interfaces.torch_bases import CustomOp
from asyncengine.models.layers.norm import RMSNorm, rms_norm_native
from asyncengine.interfaces.custom_op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.models.layers.op_registry import call_op, provider_order, register_op_impl, set_op_priority
from asyncengine.models.layers.rotary import RotaryEmbedding, rotary_native
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.platforms.cuda import CudaPlatform
from asyncengine.interfaces.platform import Platform
from asyncengine.interfaces.roles import WORKER
from asyncengine.interfaces.tables import all_registries
from asyncengine.interfaces.registry import RegistrationError
from support.platforms import use_platform


class NpuPlatform(Platform):
    """An out-of-tree platform, as a platform plugin would return."""

    device_name = "npu_example"
    device_type = "npu"
    dist_backend = "gloo"


@pytest.fixture(autouse=True)
def tables(monkeypatch):
    private_op_tables(monkeypatch)
    on(monkeypatch, CpuPlatform)


def on(monkeypatch, platform) -> None:
    use_platform(monkeypatch, platform)
    op_registry._chains.clear()  # the provider order depends on the platform


# --- dispatch ------------------------------------------------------------------------------------------


class Plain(CustomOp):
    def forward_native(self, x):
        return "native"


class WithCpu(Plain):
    def forward_cpu(self, x):
        return "cpu"


class WithOot(Plain):
    def forward_oot(self, x):
        return "oot"


class WithNpu(WithOot):
    def forward_npu(self, x):
        return "npu"


class WithCuda(WithOot):
    def forward_cuda(self, x):
        return "cuda"


class InTreeNpuKernel(Plain):
    def forward_npu(self, x):
        return "npu"


class ReplacesInTreeNpuKernel(InTreeNpuKernel):  # a plugin's register_oot subclass of an in-tree op
    def forward_oot(self, x):
        return "oot"


@pytest.mark.parametrize(
    "platform, op, expected",
    [
        (CpuPlatform, Plain, "native"),
        (CpuPlatform, WithCpu, "cpu"),
        (CpuPlatform, WithOot, "native"),  # forward_oot is for out-of-tree platforms only
        (CudaPlatform, WithCuda, "cuda"),
        (CudaPlatform, WithCpu, "native"),
        (NpuPlatform, WithNpu, "npu"),  # the platform's own device type wins
        (NpuPlatform, InTreeNpuKernel, "npu"),
        (NpuPlatform, ReplacesInTreeNpuKernel, "oot"),  # ...but not over a forward_oot defined below it
        (NpuPlatform, WithOot, "oot"),
        (NpuPlatform, WithCpu, "native"),
    ],
)
def test_forward_dispatches_by_the_platform(monkeypatch, platform, op, expected):
    on(monkeypatch, platform)
    assert op()(None) == expected


def test_the_choice_is_made_once_per_instance(monkeypatch):
    op = WithCpu()
    assert op(None) == "cpu"
    on(monkeypatch, NpuPlatform)
    assert op(None) == "cpu"  # kept
    assert WithCpu()(None) == "native"  # a new instance decides anew


def test_before_the_platform_is_resolved_forward_says_so(monkeypatch):
    on(monkeypatch, None)
    with pytest.raises(Exception, match="platform is not resolved"):
        Plain()(None)


# --- register and register_oot -------------------------------------------------------------------------


def test_the_in_tree_ops_are_registered_by_name():
    assert {"RMSNorm", "RotaryEmbedding", "SiluAndMul"} <= set(op_registry.in_tree_op_names())
    assert isinstance(RMSNorm(4, 1e-6, dtype=torch.float32), CustomOp)


def test_register_needs_a_custom_op_with_forward_native():
    with pytest.raises(RegistrationError, match="must define forward_native"):
        CustomOp.register("NoReference")(type("NoReference", (CustomOp,), {}))
    with pytest.raises(RegistrationError, match="decorates a CustomOp subclass"):
        CustomOp.register("NotAnOp")(type("NotAnOp", (), {}))


def test_register_a_new_in_tree_op_then_a_clash_names_both():
    class Mine(Plain):
        pass

    class Theirs(Plain):
        pass

    CustomOp.register("Mine")(Mine)
    CustomOp.register("Mine")(Mine)  # the same class again: a no-op
    with pytest.raises(RegistrationError, match="already registered to .*Mine .*tried to register .*Theirs"):
        CustomOp.register("Mine")(Theirs)
    CustomOp.register_oot(Theirs, name="Mine")  # now an in-tree name that can be replaced
    assert type(Mine()) is Theirs


class OotNorm(RMSNorm):
    def forward_native(self, x, residual=None):
        return "oot norm"


class StandaloneNorm(CustomOp):
    """Not a subclass of the in-tree op: built whole, with the same arguments."""

    def __init__(self, hidden_size, eps, *, dtype):
        super().__init__()
        self.args = (hidden_size, eps, dtype)

    def forward_native(self, x, residual=None):
        return "standalone"


def test_register_oot_replaces_the_in_tree_op_where_it_is_built():
    CustomOp.register_oot(name="RMSNorm")(OotNorm)
    norm = RMSNorm(8, 1e-5, dtype=torch.float32)
    assert type(norm) is OotNorm and norm.weight.shape == (8,) and norm.eps == 1e-5
    assert norm(torch.ones(1, 8)) == "oot norm"
    assert type(OotNorm(8, 1e-5, dtype=torch.float32)) is OotNorm  # building the replacement itself


def test_a_replacement_need_not_subclass_the_in_tree_op():
    CustomOp.register_oot(StandaloneNorm, name="RMSNorm")
    norm = RMSNorm(8, 1e-5, dtype=torch.bfloat16)
    assert type(norm) is StandaloneNorm and norm.args == (8, 1e-5, torch.bfloat16)


def test_subclasses_of_an_in_tree_op_are_not_replaced():
    CustomOp.register_oot(StandaloneNorm, name="RMSNorm")

    class GemmaStyleNorm(RMSNorm):
        pass

    assert type(GemmaStyleNorm(4, 1e-6, dtype=torch.float32)) is GemmaStyleNorm


def test_register_oot_with_an_unknown_name_lists_the_op_names():
    with pytest.raises(RegistrationError) as info:
        CustomOp.register_oot(name="LayerNorm")(OotNorm)
    assert isinstance(info.value, ConfigError)
    assert "'LayerNorm' is not an in-tree custom op" in str(info.value)
    assert "RMSNorm, RotaryEmbedding, SiluAndMul" in str(info.value)
    with pytest.raises(RegistrationError, match="the op names are"):
        CustomOp.register_oot(OotNorm)  # the default name is the class's: OotNorm is no in-tree op


def test_register_oot_is_idempotent_and_a_second_class_needs_override():
    CustomOp.register_oot(OotNorm, name="RMSNorm")
    CustomOp.register_oot(OotNorm, name="RMSNorm")
    with pytest.raises(RegistrationError, match="pass override=True"):
        CustomOp.register_oot(StandaloneNorm, name="RMSNorm")
    CustomOp.register_oot(StandaloneNorm, name="RMSNorm", override=True)
    assert type(RMSNorm(4, 1e-6, dtype=torch.float32)) is StandaloneNorm


# --- the in-tree ops keep their numerics ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_tree_ops_compute_what_they_did(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6, dtype=dtype)
    norm.weight.data = torch.randn(16).to(dtype)
    x, residual = torch.randn(3, 16).to(dtype), torch.randn(3, 16).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(norm(x), expected)
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(out, rms_norm_native(x + residual, norm.weight, 1e-6))

    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(x), F.silu(gate) * up)

    rotary = RotaryEmbedding(8, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    query, key = torch.randn(3, 4, 8).to(dtype), torch.randn(3, 2, 8).to(dtype)
    cos, sin = rotary.lookup(torch.tensor([0, 5, 9]), dtype)
    rotated = torch.cat((-query[..., 4:], query[..., :4]), dim=-1)
    q, k = rotary(query, key, (cos, sin))
    assert torch.equal(q, query * cos + rotated * sin) and torch.equal(k, rotary_native(query, key, cos, sin)[1])


# --- op providers --------------------------------------------------------------------------------------


def doubled(x):
    return silu_and_mul_native(x) * 2


def tripled(x):
    return silu_and_mul_native(x) * 3


def test_native_alone_runs_the_torch_reference():
    assert provider_order("silu_and_mul") == (["native"], "registered priorities")
    x = torch.randn(2, 6)
    assert torch.equal(call_op("silu_and_mul", x), silu_and_mul_native(x))


def test_providers_are_tried_by_priority_with_native_last():
    register_op_impl("silu_and_mul", "low", tripled)
    register_op_impl("silu_and_mul", "high", doubled, priority=10)
    assert provider_order("silu_and_mul")[0] == ["high", "low", "native"]
    x = torch.randn(2, 6)
    assert torch.equal(call_op("silu_and_mul", x), doubled(x))


def test_supported_is_asked_per_call():
    calls = []

    def only_even_rows(x):
        calls.append(x.shape)
        return x.shape[0] % 2 == 0

    register_op_impl("silu_and_mul", "even", doubled, supported=only_even_rows)
    even, odd = torch.randn(2, 6), torch.randn(3, 6)
    assert torch.equal(call_op("silu_and_mul", even), doubled(even))
    assert torch.equal(call_op("silu_and_mul", odd), silu_and_mul_native(odd))  # falls through to native
    assert calls == [(2, 6), (3, 6)]
    assert torch.equal(SiluAndMul()(even), doubled(even))  # the in-tree op goes through the providers


def test_the_platform_order_then_the_config_order(monkeypatch):
    register_op_impl("silu_and_mul", "a", doubled, priority=5)
    register_op_impl("silu_and_mul", "b", tripled)

    class Preferring(CpuPlatform):
        op_priority = {"silu_and_mul": ["b", "not_installed_here"]}

    on(monkeypatch, Preferring)
    assert provider_order("silu_and_mul") == (["b", "a", "native"], "the cpu platform's order")
    set_op_priority({"silu_and_mul": ["native", "a"]})
    assert provider_order("silu_and_mul") == (["native", "a", "b"], "op_priority in the config")
    x = torch.randn(2, 6)
    assert torch.equal(call_op("silu_and_mul", x), silu_and_mul_native(x))  # native supports all: b never runs
    set_op_priority({})
    assert torch.equal(call_op("silu_and_mul", x), tripled(x))


def test_config_names_are_checked_against_the_providers():
    with pytest.raises(ConfigError, match="its providers are: native") as info:
        set_op_priority({"silu_and_mul": ["fast"]})
    assert info.value.field == "op_priority"
    with pytest.raises(ConfigError, match="the ops are: fused_moe, rms_norm, rotary, sample, silu_and_mul"):
        set_op_priority({"gelu": ["native"]})


def test_register_op_impl_validates_and_is_idempotent():
    register_op_impl("silu_and_mul", "a", doubled)
    register_op_impl("silu_and_mul", "a", doubled)
    with pytest.raises(RegistrationError, match="pass override=True"):
        register_op_impl("silu_and_mul", "a", tripled)
    register_op_impl("silu_and_mul", "a", tripled, override=True)
    assert torch.equal(call_op("silu_and_mul", torch.ones(1, 2)), tripled(torch.ones(1, 2)))
    for bad in (dict(op="", provider="p", fn=doubled), dict(op="x", provider="a/b", fn=doubled),
                dict(op="x", provider="p", fn=3), dict(op="x", provider="p", fn=doubled, priority="high"),
                dict(op="x", provider="p", fn=doubled, supported=True)):
        with pytest.raises(RegistrationError):
            register_op_impl(**bad)


def test_an_op_whose_providers_all_decline_says_so():
    register_op_impl("gelu", "picky", doubled, supported=lambda x: False)
    with pytest.raises(op_registry.NoOpProvider, match="no provider of op 'gelu' supports these arguments"):
        call_op("gelu", torch.ones(1, 2))


# --- start-up records and the manifest ------------------------------------------------------------------


def test_the_start_up_records_name_each_op_provider_and_replacement(monkeypatch):
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "worker rank 0")
    register_op_impl("silu_and_mul", "fast", doubled, supported=lambda x: True)
    CustomOp.register_oot(OotNorm, name="RMSNorm")
    records = {r.plugin: r for r in op_registry.startup_records("load model")}
    assert set(records) == {"op:fused_moe", "op:rms_norm", "op:rotary", "op:sample", "op:silu_and_mul",
                            "custom op:RMSNorm"}
    assert {r.phase for r in records.values()} == {"load model"}
    assert {r.role for r in records.values()} == {"worker rank 0"}
    assert records["op:rms_norm"].reason == "provider native (priority list: native; from registered priorities)"
    assert records["op:silu_and_mul"].reason.startswith(
        "provider fast (priority list: fast, native; from registered priorities); fast is asked per call")
    assert "OotNorm replaces the in-tree RMSNorm (registered by the calling script)" in records["custom op:RMSNorm"].reason


def test_both_registries_are_compared_in_the_workers():
    registries = all_registries()
    for name in ("custom_ops", "op_providers"):
        assert registries[name][1] == frozenset({WORKER})
    assert {"RMSNorm", "SiluAndMul", "RotaryEmbedding", "FusedMoE"} <= set(CustomOpRegistry.keys())
    assert {"rms_norm/native", "rotary/native", "sample/native", "silu_and_mul/native",
            "fused_moe/native"} <= set(OpProviderRegistry.keys())
    assert CustomOpRegistry.owners()["RMSNorm"] == "built-in"


def test_the_plugin_api_exports_them():
    from asyncengine import plugins_api

    assert plugins_api.CustomOp is CustomOp and plugins_api.register_op_impl is register_op_impl
    assert {"CustomOp", "register_op_impl"} <= set(plugins_api.__all__)


def test_importing_the_plugin_api_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, asyncengine.plugins_api; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr  # CustomOp (an nn.Module) loads when asked for
