"""PrivateUsePlatform: an out-of-tree platform on torch's PrivateUse1 dispatch key."""

from typing import TYPE_CHECKING

from vllm import envs
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig
else:
    VllmConfig = None


class PrivateUsePlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "PrivateUseDevice"
    device_type: str = "privateuseone"
    dispatch_key: str = "PrivateUse1"

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        if envs.VLLM_USE_V1:
            vllm_config.compilation_config.custom_ops = ["all"]

    def get_attn_backend_cls(self, backend_name, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla):
        return "vllm_shaped_privateuse.attention.PrivateUseAttentionBackend"
