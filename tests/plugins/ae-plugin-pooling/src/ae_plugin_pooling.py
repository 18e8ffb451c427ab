"""A general plugin for pooling models: an embedding architecture (AeTinyEmbedding, by path, so that registering
imports no torch), a max-over-tokens pooler, and an IO processor that turns pooled outputs into its own answer."""

from asyncengine.plugins_api import IOProcessor, ModelRegistry, Pooler, register_pooler


class MaxPooler(Pooler):
    """The largest value of each hidden dimension over the prompt's tokens."""

    def pool(self, hidden_states, lengths):
        return [chunk.max(dim=0).values for chunk in hidden_states.split(lengths)]


def register():
    ModelRegistry.register_model("AeTinyEmbedding", "ae_plugin_pooling_model:AeTinyEmbedding")
    register_pooler("ae_max", "ae_plugin_pooling:MaxPooler")


class ArgmaxProcessor(IOProcessor):
    """`data: {"token_ids": [[...], ...]}` in; each prompt's pooled vector reduced to its largest dimension out."""

    def pre_process(self, request):
        return [list(ids) for ids in request.data["token_ids"]]

    def post_process(self, outputs):
        return {"argmax": [int(output.outputs.data.argmax()) for output in outputs],
                "sizes": [int(output.outputs.data.numel()) for output in outputs]}


def io_processor():
    return ArgmaxProcessor
