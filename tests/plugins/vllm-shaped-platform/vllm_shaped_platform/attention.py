"""vLLM's form of an attention backend: a descriptor class naming its implementation (get_impl_cls),
whose constructor is vLLM's AttentionImpl's. Its forward is what a port changes by hand: our engine's
arguments (docs/porting.md#attention-backends), here handed to the in-tree paged attention."""

from vllm.attention.backends.abstract import AttentionBackend

from vllm_shaped_platform import note


class ShapedAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None):
        # The one asyncengine name in this package: the kernel a ported forward calls.
        from asyncengine.plugins_api import AttentionBackendRegistry

        note("attention impl", num_heads=num_heads, head_size=head_size, num_kv_heads=num_kv_heads,
             kv_cache_dtype=kv_cache_dtype)
        self.kernel = AttentionBackendRegistry.backend_class("TORCH_PAGED")(num_heads, num_kv_heads, head_size, scale)

    def forward(self, query, key, value, kv_cache, metadata):
        return self.kernel.forward(query, key, value, kv_cache, metadata)


class ShapedAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name():
        return "SHAPED_ATTN"

    @staticmethod
    def get_impl_cls():
        return ShapedAttentionImpl

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError("asyncengine builds the attention metadata itself")

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)
