"""The platform's attention backend, as vLLM's test platform writes one: a placeholder with a name."""

from vllm.attention.backends.placeholder_attn import PlaceholderAttentionBackend


class PrivateUseAttentionBackend(PlaceholderAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "PrivateUse_Backend"
