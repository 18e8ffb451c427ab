"""Tiny random-weight pooling models saved as HF directories (issue 18): BERT-family encoders and classifiers,
and a decoder classifier, with transformers' model kept as the reference. LayerNorm weights and biases are
randomized too (transformers starts them at ones and zeros, which would leave their loading untested)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=128, type_vocab_size=2, layer_norm_eps=1e-12)


@dataclass
class TinyPoolingModel:
    path: Path
    hf_model: torch.nn.Module  # float32


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("LayerNorm.weight") or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def build(kind: str, directory: Path, *, seed: int = 0, tokenizer_from: Path | None = None) -> TinyPoolingModel:
    """kind: "bert" (BertModel), "bert-classifier" (BertForSequenceClassification, one label: a cross-encoder),
    "xlm-roberta-classifier" (3 labels), "qwen3-classifier" (Qwen3ForSequenceClassification, 3 labels).
    `tokenizer_from`: a model directory whose tokenizer files are copied in (its vocabulary size is used)."""
    import transformers

    vocab = 30522 if tokenizer_from is not None else 997
    torch.manual_seed(seed)
    if kind in ("bert", "bert-classifier"):
        config = transformers.BertConfig(vocab_size=vocab, initializer_range=0.2, num_labels=1, **BERT)
        cls = transformers.BertModel if kind == "bert" else transformers.BertForSequenceClassification
    elif kind == "xlm-roberta-classifier":
        config = transformers.XLMRobertaConfig(vocab_size=vocab, initializer_range=0.2, num_labels=3,
                                               pad_token_id=1, **{**BERT, "max_position_embeddings": 130})
        cls = transformers.XLMRobertaForSequenceClassification
    elif kind == "qwen3-classifier":
        config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=vocab,
                                          max_position_embeddings=256, initializer_range=0.2, num_labels=3,
                                          pad_token_id=0, rms_norm_eps=1e-6)
        cls = transformers.Qwen3ForSequenceClassification
    else:
        raise ValueError(kind)
    model = cls(config)
    _randomize(model, seed + 1)
    model.eval()
    model.save_pretrained(directory)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tokenizer_from / name, directory / name)
    return TinyPoolingModel(directory, model)
