"""vLLM's form of an out-of-tree op: decorate a subclass of the in-tree op with the in-tree op's own
register_oot; its forward_oot calls the base's."""

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from vllm_shaped_platform import note


@RotaryEmbedding.register_oot
class ShapedRotaryEmbedding(RotaryEmbedding):
    noted = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.addition_config = True

    def forward_oot(self, *args, **kwargs):
        if not ShapedRotaryEmbedding.noted:
            ShapedRotaryEmbedding.noted = True
            note("rotary forward_oot")
        return super().forward_oot(*args, **kwargs)
