"""ShapedPlatform: vLLM's CPU platform with vLLM's hook shapes."""

from typing import TYPE_CHECKING

from vllm import envs
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum

from vllm_shaped_platform import note

if TYPE_CHECKING:
    from vllm.config import VllmConfig
else:
    VllmConfig = None


class ShapedPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    device_name = "ShapedDevice"
    device_type = "cpu"
    dispatch_key = "CPU"
    # no dist_backend: vLLM's platforms may leave it to the default

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        parallel_config = vllm_config.parallel_config
        scheduler_config = vllm_config.scheduler_config
        if parallel_config.worker_cls == "auto":
            if scheduler_config.is_multi_step:
                raise NotImplementedError("multi-step scheduling is gone")
            elif vllm_config.speculative_config:
                raise NotImplementedError("no speculative decoding here")
            elif envs.VLLM_USE_V1:
                parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
        cache_config = vllm_config.cache_config
        if cache_config and cache_config.block_size is None:
            cache_config.block_size = 16
        if envs.VLLM_USE_V1:
            vllm_config.compilation_config.custom_ops = ["all"]
        scheduler_config.scheduler_cls = "vllm_shaped_platform.scheduler.CountingScheduler"
        note("check_and_update_config", worker_cls=parallel_config.worker_cls,
             scheduler_cls=scheduler_config.scheduler_cls)

    def get_attn_backend_cls(self, selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1,
                             use_mla, has_sink=False, use_sparse=False):
        note("get_attn_backend_cls", head_size=head_size, block_size=block_size, use_v1=use_v1, use_mla=use_mla,
             kv_cache_dtype=kv_cache_dtype)
        return "vllm_shaped_platform.attention.ShapedAttentionBackend"  # vLLM's descriptor form

    @classmethod
    def is_async_output_supported(cls, enforce_eager):
        return False
