"""TokenCapProcessor: a request with extra_args={"max_token_id": N} samples only token ids below N."""

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from token_cap import note


class TokenCapProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        self.caps = {}  # batch row -> the cap of the request in it
        self.noted = False

    @classmethod
    def validate_params(cls, params):
        cap = (params.extra_args or {}).get("max_token_id")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_token_id must be a positive integer, got {cap!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.caps.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            cap = (params.extra_args or {}).get("max_token_id")
            if cap is None:
                self.caps.pop(index, None)
            else:
                self.caps[index] = cap
        for source, target, direction in batch_update.moved:
            moving = self.caps.pop(source, None)
            staying = self.caps.pop(target, None)
            if direction == MoveDirectionality.SWAP and staying is not None:
                self.caps[source] = staying
            if moving is not None:
                self.caps[target] = moving

    def apply(self, logits):
        if not self.noted:
            self.noted = True
            note("logits processor apply")
        for index, cap in self.caps.items():
            logits[index, cap:] = float("-inf")
        return logits
