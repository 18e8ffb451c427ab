"""Registries (idempotent registration, owners, override) and the platform checks that need no process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncengine.errors import StartupError
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.platform_resolution import check_platform
from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, current_registrant


class Kernel:
    pass


class OtherKernel:
    pass


def registered_by(owner: str, registry: Registry, key: str, implementation, **kwargs) -> None:
    token = current_registrant.set(owner)
    try:
        registry.register(key, implementation, **kwargs)
    finally:
        current_registrant.reset(token)


def test_the_same_implementation_twice_is_a_no_op_keeping_the_first_owner():
    registry = Registry("kernels", "kernel")
    registered_by("plugin 'a'", registry, "fast", Kernel)
    registered_by("plugin 'b'", registry, "fast", Kernel)
    registered_by("plugin 'b'", registry, "fast", f"{__name__}:Kernel")  # the same class, named by path
    assert registry.owners() == {"fast": "plugin 'a'"}
    assert registry.get("fast").implementation is Kernel


def test_another_implementation_under_a_taken_key_names_both_owners():
    registry = Registry("kernels", "kernel")
    registered_by("plugin 'a'", registry, "fast", Kernel)
    with pytest.raises(RegistrationError) as caught:
        registered_by("plugin 'b'", registry, "fast", OtherKernel)
    assert str(caught.value) == (
        f"kernel 'fast' is already registered to {__name__}:Kernel (by plugin 'a'); plugin 'b' tried to register "
        f"{__name__}:OtherKernel: pass override=True to replace it"
    )
    assert registry.get("fast").implementation is Kernel  # nothing changed


def test_override_replaces_and_records_the_new_owner():
    registry = Registry("kernels", "kernel")
    registry.register("fast", Kernel, owner=BUILT_IN)
    registered_by("plugin 'b'", registry, "fast", OtherKernel, override=True)
    assert registry.get("fast").implementation is OtherKernel
    assert registry.owners() == {"fast": "plugin 'b'"}


def test_outside_a_plugin_the_owner_is_the_calling_script():
    registry = Registry("kernels", "kernel")
    registry.register("mine", Kernel)
    assert registry.owners() == {"mine": "the calling script"}


@pytest.mark.parametrize("key", ["", None, 3])
def test_a_key_must_be_a_non_empty_string(key):
    with pytest.raises(RegistrationError, match=r"a kernel needs a non-empty string key, got"):
        Registry("kernels", "kernel").register(key, Kernel)


def test_the_model_registry_names_the_built_ins_as_owned_by_built_in():
    from asyncengine.interfaces.models import ModelRegistry

    owners = ModelRegistry.owners()
    assert owners["LlamaForCausalLM"] == BUILT_IN and owners["Qwen3ForCausalLM"] == BUILT_IN


def test_current_platform_raises_before_resolution_in_a_fresh_interpreter():
    code = (
        "import asyncengine, asyncengine.plugins_api as api\n"
        "from asyncengine.errors import StartupError\n"
        "try:\n    api.current_platform()\n"
        "except StartupError as error:\n    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "the platform is not resolved yet: it is chosen in the first start-up phase of a process "
        "(AsyncEngine.start, LLM(...), the CLI); code that needs it must run after that"
    )


def test_a_platform_lacking_an_identity_attribute_or_a_hook_is_named():
    class Nameless(CpuPlatform):
        device_name = None

    class Hookless(CpuPlatform):
        set_device = None

    with pytest.raises(StartupError, match=r"^platform Nameless lacks 'device_name': set it on the class$"):
        check_platform(Nameless)
    with pytest.raises(StartupError, match=r"^platform Hookless lacks the hook 'set_device' \(it must be callable\)$"):
        check_platform(Hookless)
    with pytest.raises(StartupError, match=r"is not a subclass of asyncengine.plugins_api.Platform"):
        check_platform(object)
