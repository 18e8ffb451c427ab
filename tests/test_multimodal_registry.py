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


def test_what_a_lazy_entrys_import_registers_belongs_to_that_entrys_owner(tmp_path, monkeypatch):
    # The known bug: a model module imported lazily (its ModelRegistry entry a path) registered its processor as
    # "the calling script", whoever's entry it was.
    from asyncengine.interfaces.registry import Registry, current_registrant

    side = MultiModalRegistry()
    (tmp_path / "ae_probe_tables.py").write_text("TABLES = {}\n")
    (tmp_path / "ae_probe_vlm.py").write_text(
        "from ae_probe_tables import TABLES\n"
        "from asyncengine.interfaces.multimodal_registry import BaseMultiModalProcessor, BaseProcessingInfo, "
        "BaseDummyInputsBuilder\n"
        "class ProbeProcessor(BaseMultiModalProcessor):\n    pass\n"
        "@TABLES['side'].register_processor(ProbeProcessor, info=BaseProcessingInfo, "
        "dummy_inputs=BaseDummyInputsBuilder)\n"
        "class ProbeVLM:\n    supports_multimodal = True\n    def load_weights(self, weights):\n        return set()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ae_probe_tables

    ae_probe_tables.TABLES["side"] = side
    models = Registry("probe_models", "probe model")
    models.register("ProbeVLM", "ae_probe_vlm:ProbeVLM", owner="plugin 'probe' (probe-dist)")
    assert current_registrant.get() == "the calling script"
    model_cls = models.load("ProbeVLM")
    assert side.owners() == {"ae_probe_vlm:ProbeVLM": "plugin 'probe' (probe-dist)"}
    assert current_registrant.get() == "the calling script"  # restored after the import
    assert side.registration(model_cls, "the worker rank 0 (pid 1)").processor.__name__ == "ProbeProcessor"


def test_a_multimodal_class_with_no_registration_fails_naming_the_class_and_the_process():
    from asyncengine.errors import MissingRegistration

    registry = MultiModalRegistry()

    class Unregistered:
        supports_multimodal = True

    with pytest.raises(MissingRegistration, match=r"multimodal model class .*Unregistered has no processor registered "
                                                  r"in 'multimodal_processors' \(MULTIMODAL_REGISTRY\) in the worker "
                                                  r"rank 0 \(pid 7\): decorate the class"):
        registry.registration(Unregistered, "the worker rank 0 (pid 7)")


def test_every_built_in_multimodal_class_is_registered_and_built_in():
    from asyncengine.interfaces.models import ModelRegistry
    from asyncengine.plugins_api import MULTIMODAL_REGISTRY

    for architecture in ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                         "SmolVLMForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                         "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration"):
        model_cls = ModelRegistry.load(architecture)
        MULTIMODAL_REGISTRY.registration(model_cls, "this test")  # raises when it has none
    owners = {key: owner for key, owner in MULTIMODAL_REGISTRY.owners().items() if key.startswith("asyncengine.")}
    assert len(owners) == 4 and set(owners.values()) == {"built-in"}, owners  # SmolVLM, Qwen2.5-VL: inherited


def test_the_frontend_refuses_a_multimodal_class_with_no_registration():
    import os
    from types import SimpleNamespace

    from asyncengine.errors import MissingRegistration
    from asyncengine.frontend.multimodal import multimodal_inputs
    from asyncengine.interfaces.models import ModelRegistry

    class StubVLM:
        supports_multimodal = True

        def load_weights(self, weights):
            return set()

    model_config = SimpleNamespace(load_hf_config=lambda: SimpleNamespace(architectures=["StubVLMForTest"],
                                                                          vision_config={}))
    ModelRegistry.register_model("StubVLMForTest", StubVLM)
    try:
        with pytest.raises(MissingRegistration, match=rf"StubVLM has no processor registered .* in the frontend "
                                                      rf"\(pid {os.getpid()}\)"):
            multimodal_inputs(SimpleNamespace(model_class_overrides=None), model_config, object())
    finally:  # the process-wide table as it was
        ModelRegistry._entries.pop("StubVLMForTest", None)
