"""DeepPlatform: vLLM's CPU platform whose worker is its own subclass of vLLM's CPU worker."""

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum

from vllm_shaped_deep import failing

logger = init_logger(__name__)


class DeepPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    device_name = "DeepDevice"
    device_type = "cpu"
    dispatch_key = "CPU"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = "vllm_shaped_deep.worker.DeepWorker"

    @classmethod
    def set_device(cls, device) -> None:
        if failing("set_device"):
            raise RuntimeError("DeepDevice cannot be selected: no such card")
        logger.debug("DeepDevice %s selected", device)
