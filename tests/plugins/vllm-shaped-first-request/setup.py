# Plugins written against vLLM's API that would pass start-up and fail at the first request: each breaks
# one contract (tests/plugin_runtime/test_vllm_shaped_contracts.py picks one with the allow-list).
from setuptools import setup

setup(
    name="vllm_shaped_first_request",
    version="0.1",
    packages=["vllm_shaped_first_request"],
    entry_points={
        "vllm.stat_logger_plugins": ["v0_stats = vllm_shaped_first_request:V0StatLogger"],
        "vllm.endpoint_plugins": [
            "router_only = vllm_shaped_first_request:make_router_only",
            # vLLM's own form: the entry point is the class, which need not subclass anything
            "fastapi_protocol = vllm_shaped_first_request:ProtocolEndpoint",
            "no_routes = vllm_shaped_first_request:NoRoutes",
        ],
        "vllm.platform_plugins": ["descriptor_platform = vllm_shaped_first_request:descriptor_platform"],
        "vllm.general_plugins": ["cuda_only_op = vllm_shaped_first_request:register_cuda_only_op"],
    },
)
