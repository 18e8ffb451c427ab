"""vLLM's Platform questions that its 2024 platform-plugin test asks of a platform that does not define
them: `get_device_name()` and `is_async_output_supported(enforce_eager=True) is False`."""

from __future__ import annotations

from asyncengine.plugins_api import CpuPlatform, Platform


class DummyPlatform(Platform):  # the 2024 form: a bare Platform with a name and an __init__
    device_name = "dummy"

    def __init__(self):
        super().__init__()


def test_a_platform_answers_vllms_questions_it_does_not_define():
    for platform in (DummyPlatform, DummyPlatform(), CpuPlatform):
        assert platform.is_async_output_supported(enforce_eager=True) is False
    assert DummyPlatform.get_device_name() == "dummy" and CpuPlatform.get_device_name() == "cpu"
