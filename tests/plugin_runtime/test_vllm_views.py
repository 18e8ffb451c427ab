"""vLLM's platform contracts on our config and platform objects, in-process: the sub-config views,
check_and_update_config returning None, `current_platform` as an object, get_attn_backend_cls by keyword."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncengine.config.engine import EngineConfig
from asyncengine.config.vllm_views import collecting_ignored
from asyncengine.errors import ConfigError, StartupError
from asyncengine.platforms.interface import ask_attn_backend
from asyncengine.plugins_api import CpuPlatform, PlatformEnum


def test_views_read_and_write_through_and_note_what_has_no_meaning():
    config = EngineConfig()
    with collecting_ignored() as notes:
        config.parallel_config.tensor_parallel_size = 2
        config.cache_config.block_size = 32
        config.scheduler_config.max_num_seqs = 8
        config.compilation_config.custom_ops = ["all"]
        assert config.compilation_config.custom_ops == ["all"]  # kept, so the hook reads back what it wrote
        assert config.model_config.override_attention_dtype is None
        assert config.lora_config is None
        assert config.parallel_config.world_size == 2 and config.parallel_config.pipeline_parallel_size == 1
    assert (config.tensor_parallel_size, config.block_size, config.max_num_seqs) == (2, 32, 8)
    assert notes == ["compilation_config.custom_ops = ['all'] was set: it has no meaning in asyncengine and is ignored",
                     "model_config.override_attention_dtype was read: it has no meaning in asyncengine, so it reads "
                     "None",
                     "lora_config was read: asyncengine has none, so it reads None"]
    config.parallel_config.pipeline_parallel_size = 2
    assert config.pipeline_parallel_size == 2 and config.parallel_config.world_size == 4
    with pytest.raises(ConfigError, match="parallel_config.world_size = 3: asyncengine has 4"):
        config.parallel_config.world_size = 3
    with pytest.raises(AttributeError, match="has no attribute 'not_a_vllm_name'"):
        config.not_a_vllm_name  # noqa: B018  (only vLLM's section names read None)


class InPlacePlatform(CpuPlatform):
    device_name = "in_place"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)  # ours returns the config; a vLLM subclass ignores that
        vllm_config.scheduler_config.scheduler_cls = "pkg.mod.Scheduler"


def test_check_and_update_config_may_change_the_config_in_place_and_return_none():
    from asyncengine.plugin_runtime.phases import _updated_by_platform
    from asyncengine.plugin_runtime.records import StartupTrace

    given = EngineConfig()
    updated = _updated_by_platform(given, InPlacePlatform, StartupTrace("frontend"))
    assert updated.scheduler_cls == "pkg.mod.Scheduler" and updated.worker_cls == "asyncengine.worker.worker:Worker"
    assert given.scheduler_cls is None and given.worker_cls == "auto"  # the caller's config is left as it was


class KeywordPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT

    def get_attn_backend_cls(self, selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla,
                             has_sink=False):
        return {"head_size": head_size, "block_size": block_size, "use_mla": use_mla, "self": type(self).__name__}


class UnfillablePlatform(CpuPlatform):
    device_name = "unfillable"

    @classmethod
    def get_attn_backend_cls(cls, head_size, dtype, block_size, some_new_flag):
        return "TORCH_PAGED"


def test_get_attn_backend_cls_is_called_by_keyword_on_an_instance_when_it_is_an_instance_method():
    assert ask_attn_backend(KeywordPlatform, 64, "float32", 16) == {
        "head_size": 64, "block_size": 16, "use_mla": False, "self": "KeywordPlatform"}
    assert ask_attn_backend(CpuPlatform, 64, "float32", 16) == "TORCH_PAGED"  # ours: (head_dim, dtype, block_size)
    with pytest.raises(StartupError, match="has a parameter 'some_new_flag' that asyncengine cannot fill"):
        ask_attn_backend(UnfillablePlatform, 64, "float32", 16)
    assert KeywordPlatform.is_out_of_tree() and CpuPlatform.is_cpu() and not CpuPlatform.is_cuda()


def test_current_platform_as_an_object_raises_before_resolution_like_the_call():
    # A fresh interpreter: nothing has resolved a platform there.
    code = ("from asyncengine.plugins_api import current_platform\n"
            "for use in (lambda: current_platform(), lambda: current_platform.device_name):\n"
            "    try:\n        use()\n    except Exception as exc:\n        print(type(exc).__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["StartupError", "StartupError"], result.stderr


def test_current_platform_as_an_object_reads_the_resolved_platform(monkeypatch):
    from asyncengine.plugin_runtime import platform_resolution as resolution
    from asyncengine.plugins_api import current_platform

    monkeypatch.setattr(resolution, "_current", KeywordPlatform)
    assert current_platform() is KeywordPlatform
    assert current_platform.device_name == "cpu" and current_platform.is_out_of_tree()
    assert current_platform.get_attn_backend_cls(None, 8, None, None, 16, True, False)["head_size"] == 8
