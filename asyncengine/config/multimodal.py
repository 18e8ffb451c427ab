"""The multimodal options of EngineConfig (docs/multimodal.md, "Flags"), checked: vLLM's names where vLLM has one.

`limit_mm_per_prompt` ({"image": N}, vLLM's shape; vLLM's newer {"image": {"count": N}} too),
`mm_processor_kwargs` (given to the model's processor, part of each image's hash), `mm_processor_cache_gb`
(the frontend's processed-image cache; 0: off), `allowed_local_media_path` and `allowed_media_domains`
(where image URLs may point). Ours, where vLLM has an environment variable or nothing: `max_image_bytes`,
`max_image_pixels`, `media_fetch_timeout`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from asyncengine.errors import ConfigError

IMAGE = "image"
DEFAULT_LIMIT_PER_PROMPT = 16  # images per prompt when --limit-mm-per-prompt does not say (vLLM's: 999)


def parse_limit_per_prompt(value: Mapping[str, Any] | None) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt as {modality: count}; images only here."""
    limits = {IMAGE: DEFAULT_LIMIT_PER_PROMPT}
    for modality, limit in (value or {}).items():
        if modality != IMAGE:
            raise ConfigError(f"limit_mm_per_prompt: modality {modality!r} is not supported (images only)",
                              field="limit_mm_per_prompt")
        if isinstance(limit, dict):  # vLLM's newer form {"image": {"count": N, ...}}
            limit = limit.get("count")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"limit_mm_per_prompt[{modality!r}] must be a count of 0 or more, got {limit!r}",
                              field="limit_mm_per_prompt")
        limits[modality] = limit
    return limits


def check_multimodal_options(config: Any) -> None:
    if not isinstance(config.limit_mm_per_prompt, Mapping):
        raise ConfigError(f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 4}}, got "
                          f"{config.limit_mm_per_prompt!r}", field="limit_mm_per_prompt")
    parse_limit_per_prompt(config.limit_mm_per_prompt)
    for name in ("max_image_bytes", "max_image_pixels"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(config, name)}", field=name)
    for name in ("mm_processor_cache_gb", "media_fetch_timeout"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value >= 0) or (name == "media_fetch_timeout" and value == 0):
            raise ConfigError(f"{name} must be a finite number {'above' if name == 'media_fetch_timeout' else 'of'} 0"
                              f"{'' if name == 'media_fetch_timeout' else ' or more'}, got {value}", field=name)
    domains = config.allowed_media_domains
    if domains is not None and not all(isinstance(domain, str) and domain.strip() for domain in domains):
        raise ConfigError(f"allowed_media_domains must be host names, got {domains!r}", field="allowed_media_domains")


__all__ = ["DEFAULT_LIMIT_PER_PROMPT", "check_multimodal_options", "parse_limit_per_prompt"]
