"""token-cap: a request with extra_args={"max_token_id": N} samples only token ids below N
(token_cap.processor), and an out-of-tree SiluAndMul that computes what the in-tree one does and
notes which process ran it (token_cap.ops)."""

import json
import os


def register_ops():
    # A general plugin runs in every process; importing the module registers the op (its decorator).
    import token_cap.ops  # noqa: F401


def note(what):
    """Append {"what", "pid"} to the file TOKEN_CAP_RECORD names, if it names one."""
    path = os.environ.get("TOKEN_CAP_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as record:
            record.write(json.dumps({"what": what, "pid": os.getpid()}) + "\n")
