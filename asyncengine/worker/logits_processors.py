"""LogitsProcessor: the interface of batch-level logits processors (vLLM v1's shape).

Loaded in workers (to build) and in the frontend (to validate per-request arguments), from the
entry-point group asyncengine.logits_processors or the `logits_processors` option.
"""

from __future__ import annotations

from typing import Any


class LogitsProcessor:
    def __init__(self, engine_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.engine_config = engine_config
        self.device = device
        self.is_pin_memory = is_pin_memory

    @classmethod
    def validate_params(cls, params: Any) -> None:
        """Raise RequestError when a request's arguments for this processor are invalid."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        raise NotImplementedError

    def apply(self, logits: Any) -> Any:
        raise NotImplementedError
