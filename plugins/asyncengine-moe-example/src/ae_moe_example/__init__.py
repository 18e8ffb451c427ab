"""A provider of op "fused_moe" (the mixture-of-experts layers' op), registered by a general plugin.

`counting_fused_moe` is provider `ae_moe_example`: it computes with asyncengine's torch reference
(`fused_moe_reference`: per expert, gather its tokens, two GEMMs, scatter back) and counts its calls, per
process, in `CALLS`. A real plugin would put its own kernel here (same arguments, same result: the project
checks each provider it ships against the reference); a plugin that accepts only some calls passes
`supported=`, and the next provider in the priority list runs the others.

With AE_PLUGIN_RECORD naming a file, each call appends one JSON line there, `{"what": "fused_moe", "call",
"tokens", "pid", "role"}`: the end-to-end test reads where the calls ran and how many there were.
It imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

import json
import os
from typing import Any

from asyncengine.plugins_api import current_process_role, register_op_impl

__all__ = ["CALLS", "PROVIDER", "counting_fused_moe", "register"]

PROVIDER = "ae_moe_example"
CALLS = {"fused_moe": 0}


def counting_fused_moe(hidden: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any, w2_bias: Any,
                       config: Any) -> Any:
    """Op "fused_moe": `hidden` [M, H], `router_logits` [M, E], experts `w13` [E, 2I, H] and `w2` [E, H, I]
    (biases or None), `config` an asyncengine MoeConfig; returns [M, H]."""
    from asyncengine.plugins_api import fused_moe_reference  # imports torch: only when a MoE layer runs

    CALLS["fused_moe"] += 1
    path = os.environ.get("AE_PLUGIN_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as record:
            record.write(json.dumps({"what": "fused_moe", "call": CALLS["fused_moe"], "tokens": hidden.shape[0],
                                     "pid": os.getpid(), "role": current_process_role()}) + "\n")
    return fused_moe_reference(hidden, router_logits, w13, w2, w13_bias, w2_bias, config)


def register() -> None:
    register_op_impl("fused_moe", PROVIDER, counting_fused_moe)
