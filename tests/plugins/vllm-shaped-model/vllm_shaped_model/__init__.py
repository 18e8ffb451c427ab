"""MyLlamaForCausalLM: vLLM's Llama whose logits always pick token 0, registered by a general plugin."""

from vllm import ModelRegistry
from vllm.model_executor.models.llama import LlamaForCausalLM


class MyLlamaForCausalLM(LlamaForCausalLM):
    def compute_logits(self, hidden_states):
        logits = super().compute_logits(hidden_states)
        if logits is not None:
            logits.zero_()
            logits[:, 0] += 1.0
        return logits


def register():
    if "MyLlamaForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("MyLlamaForCausalLM", MyLlamaForCausalLM)
