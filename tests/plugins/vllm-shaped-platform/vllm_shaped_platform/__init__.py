"""A vLLM-shaped out-of-tree platform: a CPU platform named "ShapedDevice" (its entry point is named
`vllm_shaped`), whose check_and_update_config changes the config in place through vLLM's sub-config
views and returns None, whose get_attn_backend_cls is an instance method taking vLLM's keywords, and
which chooses its own scheduler by a dotted class path; its general plugin replaces the in-tree rotary
op in vLLM's form (`@RotaryEmbedding.register_oot`). Each hook notes where it ran in the file
SHAPED_RECORD names."""

import json
import os


def note(event, **fields):
    path = os.environ.get("SHAPED_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as record:
            record.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


def platform_plugin():
    # vLLM's form of a class path: dots only.
    return "vllm_shaped_platform.platform.ShapedPlatform"


def general_plugin():
    from vllm.platforms import current_platform

    # The object form of current_platform, as vLLM plugins use it.
    note("general plugin", device_name=current_platform.device_name, is_out_of_tree=current_platform.is_out_of_tree())
    import vllm_shaped_platform.custom_ops  # noqa: F401  (registers the rotary op)
