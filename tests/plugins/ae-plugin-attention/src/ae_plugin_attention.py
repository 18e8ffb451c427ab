"""An attention backend "AE_RECORDING" that delegates every call to the built-in "TORCH_PAGED" and, on
its first forward in a process, records where it ran (the file named by AE_PLUGIN_RECORD): the worker
runs the model, so that is where it must run. Registered lazily, by path, as a plugin may."""

import json
import os

from asyncengine.plugins_api import (
    AttentionBackend,
    AttentionBackendRegistry,
    current_process_role,
    register_attention_backend,
)

_recorded = False


class RecordingBackend(AttentionBackend):
    def __init__(self, num_heads, num_kv_heads, head_dim, scale):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.inner = AttentionBackendRegistry.backend_class("TORCH_PAGED")(num_heads, num_kv_heads, head_dim, scale)

    def forward(self, query, key, value, kv_cache, metadata):
        global _recorded
        if not _recorded:
            _recorded = True
            with open(os.environ["AE_PLUGIN_RECORD"], "a") as file:
                file.write(json.dumps({"what": "attention backend forward", "pid": os.getpid(),
                                       "role": current_process_role()}) + "\n")
        return self.inner.forward(query, key, value, kv_cache, metadata)


def register():
    register_attention_backend("AE_RECORDING", "ae_plugin_attention:RecordingBackend")
