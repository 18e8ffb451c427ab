"""vLLM-shaped plugins, each missing what the engine calls at the first step or request (the two FastAPI-form
endpoint plugins miss only fastapi, which the processes that load them do not have)."""

import os

from vllm.attention.backends.abstract import AttentionBackend
from vllm.platforms.cpu import CpuPlatform
from vllm.plugins.endpoint_plugins.interface import EndpointPlugin
from vllm.v1.metrics.loggers import StatLoggerBase


class V0StatLogger(StatLoggerBase):
    """vLLM v0's shape: one stats argument."""

    def record(self, stats):
        pass


class RouterOnly(EndpointPlugin):
    """vLLM's endpoint plugin: a FastAPI router, no attach(app)."""

    name = "router_only"

    def attach_router(self, app):
        pass


def make_router_only():
    return RouterOnly()


class NoRoutes(EndpointPlugin):
    """An endpoint plugin with a name and neither attach(app) nor vLLM's attach_router(app)."""

    name = "no_routes"


class ProtocolEndpoint:
    """vLLM's endpoint plugin as its example writes it: a plain class with attach_router and init_state."""

    name = "fastapi_protocol"
    required_tasks = None

    def attach_router(self, app):
        pass

    async def init_state(self, engine_client, state, args):
        state.client = engine_client


class DescriptorBackend(AttentionBackend):
    """vLLM's backend form: a descriptor naming its implementation, no forward."""

    @staticmethod
    def get_name():
        return "DESCRIPTOR"

    @staticmethod
    def get_impl_cls():
        return object


class DescriptorPlatform(CpuPlatform):
    device_name = "descriptor_platform"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla):
        return "vllm_shaped_first_request.DescriptorBackend"


def descriptor_platform():
    # Active only when asked for (installing it must not take over the other cases).
    return "vllm_shaped_first_request.DescriptorPlatform" if os.environ.get("DESCRIPTOR_PLATFORM") else None


def register_cuda_only_op():
    from vllm.model_executor.custom_op import CustomOp

    @CustomOp.register_oot(name="SiluAndMul")
    class CudaOnlySiluAndMul(CustomOp):
        def forward_cuda(self, x):
            return x
