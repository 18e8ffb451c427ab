"""R14, the multimodal processor registry (asyncengine/interfaces/multimodal_registry.py): vLLM's decorator shape,
found through the class's MRO, idempotent, a conflict named; and vLLM's names port to it."""

from __future__ import annotations

import pytest

from asyncengine.interfaces.multimodal_registry import (
    DEFAULT_FACTORIES,
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    MultiModalRegistry,
    ProcessingContext,
    supports_multimodal,
)
from asyncengine.interfaces.registry import RegistrationError
from asyncengine.porting.codemod import port_python


class MyInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self):
        return {"image": 2}


class MyDummy(BaseDummyInputsBuilder):
    pass


class MyProcessor(BaseMultiModalProcessor):
    def placeholder(self, modality="image"):
        return "<img>"


class OtherProcessor(BaseMultiModalProcessor):
    pass


def test_register_processor_decorates_the_model_class_and_subclasses_inherit_it():
    registry = MultiModalRegistry()

    @registry.register_processor(MyProcessor, info=MyInfo, dummy_inputs=MyDummy)
    class MyVLM:
        pass

    class MyVLMVariant(MyVLM):  # vLLM's dummy LLaVA plugin: a subclass with no decorator of its own
        pass

    factories = registry.factories_for(MyVLMVariant)
    assert factories is registry.factories_for(MyVLM) and factories.processor is MyProcessor
    processor = factories.build_processor(ProcessingContext("/nowhere"))
    assert isinstance(processor, MyProcessor) and isinstance(processor.info, MyInfo)
    assert isinstance(processor.dummy_inputs, MyDummy) and processor.placeholder() == "<img>"
    assert processor.info.get_supported_mm_limits() == {"image": 2}
    assert registry.factories_for(int) is None and not registry.has_processor(object)
    key = f"{MyVLM.__module__}:{MyVLM.__qualname__}"
    assert registry.keys() == [key] and registry.owners()[key] == "the calling script"

    registry.register_processor(MyProcessor, info=MyInfo, dummy_inputs=MyDummy)(MyVLM)  # the same again: a no-op
    with pytest.raises(RegistrationError, match="already has the multimodal processor .*MyProcessor.*OtherProcessor"):
        registry.register_processor(OtherProcessor, info=MyInfo, dummy_inputs=MyDummy)(MyVLM)
    registry.register_processor(OtherProcessor, info=MyInfo, dummy_inputs=MyDummy, override=True)(MyVLM)
    assert registry.factories_for(MyVLMVariant).processor is OtherProcessor


def test_what_is_registered_is_checked():
    registry = MultiModalRegistry()
    with pytest.raises(RegistrationError, match="processor must be a subclass of BaseMultiModalProcessor"):
        registry.register_processor(object, info=MyInfo, dummy_inputs=MyDummy)  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="info must be a subclass of BaseProcessingInfo"):
        registry.register_processor(MyProcessor, info=MyDummy, dummy_inputs=MyDummy)  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="decorates a model class"):
        registry.register_processor(MyProcessor, info=MyInfo, dummy_inputs=MyDummy)(len)  # type: ignore[type-var]


def test_supports_multimodal_reads_the_class():
    class Marked:
        supports_multimodal = True

    assert supports_multimodal(Marked) and not supports_multimodal(None) and not supports_multimodal(int)
    assert DEFAULT_FACTORIES.processor is BaseMultiModalProcessor


VLLM_SOURCE = '''from vllm import ModelRegistry
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo
from vllm.multimodal.profiling import BaseDummyInputsBuilder


class Info(BaseProcessingInfo):
    pass


class Dummy(BaseDummyInputsBuilder):
    pass


class Processor(BaseMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(Processor, info=Info, dummy_inputs=Dummy)
class PortedVLM:
    supports_multimodal = True

    def load_weights(self, weights):
        return set()


def register():
    ModelRegistry.register_model("PortedVLMForTest", PortedVLM, is_multimodal=True)
'''


def test_vllms_multimodal_registration_ports_and_runs():
    from asyncengine.interfaces.models import ModelRegistry
    from asyncengine.plugins_api import MULTIMODAL_REGISTRY

    result = port_python(VLLM_SOURCE)
    assert result.unmapped == [], result.unmapped
    assert "vllm" not in result.text
    namespace: dict = {"__name__": "ported_vlm"}
    exec(compile(result.text, "ported_vlm.py", "exec"), namespace)
    try:
        namespace["register"]()
        model_cls = namespace["PortedVLM"]
        assert ModelRegistry.load("PortedVLMForTest") is model_cls
        assert MULTIMODAL_REGISTRY.factories_for(model_cls).processor is namespace["Processor"]
    finally:  # the process-wide tables as they were
        ModelRegistry._entries.pop("PortedVLMForTest", None)
        MULTIMODAL_REGISTRY._entries.pop("ported_vlm:PortedVLM", None)
        MULTIMODAL_REGISTRY._by_class.pop(namespace.get("PortedVLM"), None)  # type: ignore[arg-type]
