"""A well-behaved plugin of each kind, importing only asyncengine.plugins_api."""

from asyncengine.plugins_api import EndpointPlugin, LogitsProcessor, ModelRegistry, StatLoggerBase

# An architecture name only this plugin knows, built by asyncengine's own Llama code.
ARCHITECTURE = "PluginLlamaForCausalLM"


def register():
    ModelRegistry.register_model(ARCHITECTURE, "asyncengine.models.llama:LlamaForCausalLM")


class CountingStatLogger(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats):
        pass


class NoopLogitsProcessor(LogitsProcessor):
    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits


class Hello(EndpointPlugin):
    name = "hello"

    def attach(self, app):
        pass


def make_endpoint():
    return Hello()
