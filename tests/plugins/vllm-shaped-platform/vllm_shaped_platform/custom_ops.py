"""vLLM's form of an out-of-tree op: decorate a subclass of the in-tree op with the in-tree op's own
register_oot, with vLLM's constructor arguments; its forward_oot calls the base's."""

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from vllm_shaped_platform import note


@RotaryEmbedding.register_oot
class ShapedRotaryEmbedding(RotaryEmbedding):
    noted = False

    # vLLM's constructor, declared (vLLM's own test plugin passes *args, **kwargs through, which works too).
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype):
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        self.addition_config = True
        note("rotary built", head_size=head_size, rotary_dim=rotary_dim, base=base, is_neox_style=is_neox_style)

    def forward_oot(self, *args, **kwargs):
        if not ShapedRotaryEmbedding.noted:
            ShapedRotaryEmbedding.noted = True
            note("rotary forward_oot")
        return super().forward_oot(*args, **kwargs)
