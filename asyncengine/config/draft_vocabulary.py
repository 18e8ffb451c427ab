"""Whether a draft model's token ids mean the target's tokens: the check speculative decoding runs at start-up.

A draft proposes token ids and the target verifies them by id, so both must share one tokenizer. Their
models' `vocab_size` (the width of the logits) may still differ: checkpoints pad the embedding table
(Qwen2.5's 0.5B and 7B have 151,936 and 152,064 rows over one 151,665-token tokenizer). So the check
compares the tokenizers where they are known (their size, and a digest of their token-to-id table), and
then only asks that each model's logits cover the tokenizer; the ids both can score are the first
`min(vocab sizes)`, which is what the rejection sampler compares. Without tokenizers, the vocab sizes
must be equal: nothing else shows that the ids agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from asyncengine.config.speculative import FIELD
from asyncengine.errors import ConfigError


@dataclass(frozen=True)
class Vocabulary:
    """What the check needs of one model: `name` for messages, `vocab_size` (rows of its logits), and, when its
    tokenizer is loaded, `tokenizer_size` (len(tokenizer)) and `digest` (`tokenizer_digest`)."""

    name: str
    vocab_size: int
    tokenizer_size: int | None = None
    digest: str | None = None

    @classmethod
    def of(cls, model_config: Any, tokenizer: Any | None = None) -> Vocabulary:
        """From a ModelConfig (its `served_model_name`, `vocab_size`) and, optionally, its tokenizer."""
        return cls(name=str(getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "?")),
                   vocab_size=int(model_config.vocab_size),
                   tokenizer_size=len(tokenizer) if tokenizer is not None else None,
                   digest=tokenizer_digest(tokenizer) if tokenizer is not None else None)


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the tokenizer's (token, id) pairs, added tokens included (`get_vocab()`), in id order."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    digest = hashlib.sha256()
    for token, token_id in pairs:
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def check_draft_vocabulary(target: Vocabulary, draft: Vocabulary) -> int:
    """Refuse a draft whose token ids do not mean the target's tokens; return how many ids both score
    (min of the two vocab sizes)."""
    hint = "choose a draft from the target's model family, built over the same tokenizer"
    target_size, draft_size = target.tokenizer_size, draft.tokenizer_size
    if target_size is not None and draft_size is not None:
        if target_size != draft_size:
            raise ConfigError(f"{FIELD}: the draft {draft.name!r} has a tokenizer of {draft_size} tokens, the target "
                              f"{target.name!r} one of {target_size}: the draft's token ids would not mean the "
                              f"target's tokens; {hint}", field=FIELD)
        if target.digest is not None and draft.digest is not None and target.digest != draft.digest:
            raise ConfigError(f"{FIELD}: the draft {draft.name!r} and the target {target.name!r} have tokenizers of "
                              f"{target_size} tokens each, but their tokens have different ids; {hint}", field=FIELD)
        for vocabulary in (target, draft):
            if vocabulary.vocab_size < target_size:
                raise ConfigError(f"{FIELD}: the model {vocabulary.name!r} scores {vocabulary.vocab_size} token ids, "
                                  f"fewer than its tokenizer's {target_size}", field=FIELD)
    elif target.vocab_size != draft.vocab_size:
        raise ConfigError(f"{FIELD}: the draft {draft.name!r} has a vocabulary of {draft.vocab_size} tokens, the "
                          f"target {target.name!r} one of {target.vocab_size}; {hint}", field=FIELD)
    return min(target.vocab_size, draft.vocab_size)


__all__ = ["Vocabulary", "check_draft_vocabulary", "tokenizer_digest"]
