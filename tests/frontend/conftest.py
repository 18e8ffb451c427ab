"""Small tokenizers built in-process, so tokenizer tests need no network and no model files.

The merges come from a tiny BPE trainer written here rather than `tokenizers.trainers`: the
library's trainer breaks ties between equally frequent pairs in hash order, so its vocabulary
(and every token boundary a test relies on) changes from run to run. Ours breaks ties by the
pair itself and is deterministic.
"""

from __future__ import annotations

from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# ASCII, accented Latin, CJK and emoji (including multi-code-point ones), so that the vocabularies
# split some multi-byte characters across tokens.
SAMPLE_TEXTS = [
    "Hello world, this is a test of the streaming detokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here, or don't!",
    "Café crème brûlée à la française: naïve façade, Ærøskøbing, Świętokrzyskie.",
    "日本語のテキストです。中文文本测试，包括标点符号。한국어 문장도 있습니다.",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷🇯🇵, family 👨‍👩‍👧 and math ∑∫√ symbols.",
    "Mixed: naïve 東京 😀 café\n\nnew paragraph\twith tabs   and  spaces.",
]


def train_merges(words: list[tuple[str, ...]], num_merges: int) -> list[tuple[str, str]]:
    """Classic BPE: repeatedly merge the most frequent adjacent pair (ties: the larger pair).

    Pairs seen once are never merged, so rare characters stay split across tokens."""
    counts = Counter(words)
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in counts.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        best = max(pairs, key=lambda pair: (pairs[pair], pair), default=None)
        if best is None or pairs[best] < 2:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in counts.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        counts = merged
    return merges


def build_vocab(specials: list[str], alphabet: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in [*specials, *alphabet, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab


def build_bytelevel_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2/Qwen-style byte-level BPE: every byte is a token, rarer characters stay split."""
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = [tuple(piece) for text in SAMPLE_TEXTS for piece, _ in pre_tokenizer.pre_tokenize_str(text)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = train_merges(words, num_merges=220)
    vocab = build_vocab(specials, sorted(pre_tokenizers.ByteLevel.alphabet()), merges)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def build_metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2/sentencepiece-style BPE: "▁" marks spaces, characters outside the alphabet fall
    back to <0xNN> byte tokens, and the decoder drops the space in front of the first token."""
    pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    char_counts = Counter("".join(SAMPLE_TEXTS).replace(" ", "▁"))
    # Keep the commoner characters; the rest (most CJK and emoji) go through byte fallback.
    alphabet = sorted(ch for ch, n in char_counts.items() if n >= 2 or ch.isascii())
    words = [
        tuple(piece)
        for text in SAMPLE_TEXTS
        for piece, _ in pre_tokenizer.pre_tokenize_str(text)
        if all(ch in alphabet for ch in piece)
    ]
    specials = ["<unk>", "<s>", "</s>"]
    merges = train_merges(words, num_merges=150)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = build_vocab(specials, [*byte_tokens, *alphabet], merges)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    return list(SAMPLE_TEXTS)


@pytest.fixture(scope="session")
def bytelevel_tokenizer() -> PreTrainedTokenizerFast:
    return build_bytelevel_tokenizer()


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    return build_metaspace_tokenizer()
