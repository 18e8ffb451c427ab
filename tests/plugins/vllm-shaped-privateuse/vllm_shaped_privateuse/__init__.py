"""A vLLM-shaped platform whose device torch cannot reach here ("privateuseone"). Its entry point is
always active, as vLLM's test platform's is."""


def platform_plugin():
    return "vllm_shaped_privateuse.platform.PrivateUsePlatform"
