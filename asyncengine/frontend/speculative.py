"""The frontend's start-up checks of a speculative proposer's model (docs/speculative_decoding.md), run in the
`model` phase beside the target's, before anything is spawned: the draft's quantization method is a known
one, and the draft's token ids mean the target's tokens (`check_draft_vocabulary`: with both tokenizers
where the target's is loaded, else the models' vocabulary sizes). An EAGLE head shares the target's
embedding and head: its config's `vocab_size`, where given, must be the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncengine.config.draft_vocabulary import Vocabulary, check_draft_vocabulary
from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig, load_config_json
from asyncengine.config.speculative import FIELD
from asyncengine.errors import ConfigError
from asyncengine.frontend.tokenizer import load_tokenizer
from asyncengine.interfaces.quantization import QuantizationRegistry
from asyncengine.interfaces.registry import reads

# Files that say a model directory carries its tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@reads("quantization", "frontend")  # the draft's quantization method's name
def check_speculative_model(config: EngineConfig, target: ModelConfig, tokenizer: Any | None) -> None:
    """Refuse a draft model or EAGLE head that cannot serve this target (a ConfigError naming both)."""
    speculative = config.speculative
    if speculative is None or not speculative.uses_draft_model or speculative.model is None:
        return
    if speculative.method != "draft_model":
        _check_head_vocabulary(Path(speculative.model).expanduser(), target)
        return
    if speculative.quantization is not None:  # an unknown name fails here, listing the known ones
        try:
            QuantizationRegistry.load(speculative.quantization)
        except ConfigError as exc:
            raise ConfigError(f"{FIELD}.quantization, the draft's: {exc}", field=FIELD) from None
    # (imported here: the draft's loading code, torch's included, only where a draft is named)
    from asyncengine.worker.spec_decode.draft_model import resolve_draft_model_config

    draft = resolve_draft_model_config(speculative.model, dtype=target.dtype)
    draft_dir = Path(draft.model_dir)
    draft_tokenizer = None
    if tokenizer is not None and any((draft_dir / name).is_file() for name in _TOKENIZER_FILES):
        draft_tokenizer = load_tokenizer(draft_dir, config.tokenizer_mode, trust_remote_code=config.trust_remote_code)
    check_draft_vocabulary(Vocabulary.of(target, tokenizer), Vocabulary.of(draft, draft_tokenizer))


def _check_head_vocabulary(head_dir: Path, target: ModelConfig) -> None:
    if not head_dir.is_dir():
        raise ConfigError(f"{FIELD}.model {str(head_dir)!r} must be the EAGLE head's directory (config.json and "
                          "*.safetensors)", field=FIELD)
    head_vocab = load_config_json(head_dir).get("vocab_size")
    if head_vocab is not None and int(head_vocab) != target.vocab_size:
        raise ConfigError(f"{FIELD}: the EAGLE head {str(head_dir)!r} has a vocabulary of {head_vocab} tokens, the "
                          f"target {target.served_model_name!r} one of {target.vocab_size}: a head drafts in its "
                          "target's token ids (it shares its embedding); choose the head trained for this target",
                          field=FIELD)


__all__ = ["check_speculative_model"]
