"""C9: every `additional_config` key is claimed by the platform or a plugin, whose validator checks it;
an unclaimed key is an error. Registrations are process-global: unique key names here."""

from __future__ import annotations

import itertools

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.additional_config import check_additional_config
from asyncengine.plugins_api import AdditionalConfigRegistry, RegistrationError
from asyncengine.interfaces.tables import all_registries

_keys = (f"ae_test_key_{n}" for n in itertools.count())


def positive(value):
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"must be a positive integer, got {value!r}")


class ClaimingPlatform(CpuPlatform):
    device_name = "claiming-test"
    additional_config_keys = ("platform_knob",)


def test_an_unclaimed_key_is_an_error_listing_the_claimed_ones():
    key = next(_keys)
    AdditionalConfigRegistry.claim(key, positive)
    with pytest.raises(ConfigError) as caught:
        check_additional_config(EngineConfig(additional_config={"nobody_claims_me": 1}), ClaimingPlatform)
    message = str(caught.value)
    assert message.startswith("additional_config key 'nobody_claims_me' is claimed by no platform or plugin; "
                              "claimed keys: ")
    assert repr(key) in message and "'platform_knob'" in message
    assert caught.value.field == "additional_config"


def test_claimed_keys_pass_and_a_refusing_validator_names_the_claimant():
    key = next(_keys)
    AdditionalConfigRegistry.claim(key, positive)
    check_additional_config(EngineConfig(additional_config={key: 3, "platform_knob": "any"}), ClaimingPlatform)
    check_additional_config(EngineConfig(), CpuPlatform)  # nothing set: nothing to claim
    with pytest.raises(ConfigError, match=rf"additional_config\['{key}'\]=-1 was refused by the calling script "
                                          rf"\(validator {__name__}:positive\): ValueError: must be a positive "
                                          "integer, got -1"):
        check_additional_config(EngineConfig(additional_config={key: -1}), CpuPlatform)
    with pytest.raises(ConfigError, match="claimed by no platform"):  # the platform's key, on another platform
        check_additional_config(EngineConfig(additional_config={"platform_knob": 1}), CpuPlatform)


def test_claiming_follows_the_registry_rules():
    key = next(_keys)
    AdditionalConfigRegistry.claim(key, positive)
    AdditionalConfigRegistry.claim(key, positive)  # the same claimant again: a no-op
    with pytest.raises(RegistrationError, match="already registered"):
        AdditionalConfigRegistry.claim(key, lambda value: None)
    with pytest.raises(RegistrationError, match="must be callable"):
        AdditionalConfigRegistry.claim(next(_keys), 42)
    assert all_registries()["additional_config"][1] == frozenset({"frontend"})


@pytest.mark.parametrize("in_process", [True, False])
def test_the_frontend_checks_before_the_engine_starts(tiny_model, in_process):
    key = next(_keys)
    AdditionalConfigRegistry.claim(key, positive)
    options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, in_process=in_process)
    model = str(tiny_model("llama").path)
    with pytest.raises(ConfigError, match="additional_config key 'typo_key' is claimed by no platform or plugin"):
        LLM(model, additional_config={"typo_key": 1}, **options)
    with pytest.raises(ConfigError, match=rf"additional_config\['{key}'\]=0 was refused by the calling script"):
        LLM(model, additional_config={key: 0}, **options)
    # Only the frontend checks the claims, so the engine-core process needs no claim of its own.
    with LLM(model, additional_config={key: 2}, **options) as llm:
        (output,) = llm.generate([{"prompt_token_ids": [5, 6]}],
                                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 2
