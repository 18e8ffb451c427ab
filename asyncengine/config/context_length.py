"""The longest context a model was trained for, from its config.json (shared by the model config, which
checks `max_model_len` against it, and vLLM's config views, which show it before the model is resolved)."""

from __future__ import annotations

from typing import Any

# Keys under which configs give the longest context the model was trained for, in order of preference.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def derived_context_length(hf_config: dict[str, Any]) -> int | None:
    """The model's context length from its config (or its text tower's); None when it gives none."""
    sources = [hf_config] + [hf_config[k] for k in ("text_config",) if isinstance(hf_config.get(k), dict)]
    return next(
        (int(src[key]) for src in sources for key in CONTEXT_LENGTH_KEYS if isinstance(src.get(key), int)), None
    )
