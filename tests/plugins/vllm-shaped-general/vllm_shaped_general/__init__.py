"""vllm_shaped_general: an out-of-tree SiluAndMul computed in row chunks, which checks its tensor-parallel group
once per process. VLLM_SHAPED_GENERAL_RECORD (this plugin's own variable: vLLM does not read it) names a file
where each process appends what it saw, one JSON object a line."""

import json
import logging
import os

# vLLM's root logger: a plugin that wants its lines with vLLM's attaches to it.
vllm_root_logger = logging.getLogger("vllm")


def register():
    import vllm_shaped_general.ops  # noqa: F401  (its decorator registers the op)


def note(**fields):
    path = os.environ.get("VLLM_SHAPED_GENERAL_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as record:
            record.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")
