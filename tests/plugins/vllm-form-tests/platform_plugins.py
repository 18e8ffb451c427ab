# vLLM's test_platform_plugins.py (with its older test_oot_attention_backend), in its form, run with
# tests/plugins/vllm-shaped-privateuse installed. Differs: vLLM's test first runs an example on
# facebook/opt-125m; here the platform's device ("privateuseone") has no torch backend, so the run
# stops where the model would be placed on it, with the error asserted; the platform was resolved
# before that, so current_platform answers. The older test's override of vLLM's backend variable
# (tests.kernels.utils, vllm.utils) is left out: there is no such variable here.
import json
import os

import pytest
import torch

from vllm import LLM
from vllm.attention.selector import get_attn_backend

MODEL = os.environ["SHAPED_MODEL"]
MACHINE = json.loads(os.environ.get("SHAPED_OPTIONS", "{}"))


def test_platform_plugins():
    with pytest.raises(Exception, match="device_type 'privateuseone' has no torch backend in this process"):
        LLM(model=MODEL, **MACHINE)

    # check if the plugin is loaded correctly
    from vllm.platforms import _init_trace, current_platform

    assert current_platform.device_name == "PrivateUseDevice", (
        f"Expected PrivateUseDevice, got {current_platform.device_name}, "
        "possibly because current_platform is imported before the plugin"
        f" is loaded. The first import:\n{_init_trace}"
    )


def test_oot_attention_backend(monkeypatch):
    backend = get_attn_backend(16, torch.float16, torch.float16, 16, False)
    assert backend.get_name() == "PrivateUse_Backend"
