"""An option's one-line description, written next to its field: `max_num_seqs: Annotated[int, doc("...")] = 256`.

It is msgspec's `Meta(description=...)`, so the description travels with the type: the CLI's `--help`
shows it for the flag derived from the field (asyncengine/cli/args.py), and a JSON schema of the Struct
carries it. Written as vLLM's help texts are: a sentence saying what the option does, its values, the
unit; the default is added by the CLI.
"""

from __future__ import annotations

import msgspec


def doc(description: str) -> msgspec.Meta:
    """The field's description (one line, a sentence)."""
    return msgspec.Meta(description=description)


__all__ = ["doc"]
