"""A tiny byte-level tokenizer with a ChatML chat template, saved beside a tiny model (tests/support/tiny_models.py)
so that a server on that model serves text prompts, chat, /tokenize and /detokenize.

No merges: every byte is one token, so the ids are fixed (0-2 the special tokens, 3-258 the bytes), every
id is inside the tiny models' vocabularies (997 and up), and any text, whatever its script, tokenizes.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: eos_token_id 2 as in the models

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(directory: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for byte in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[byte] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
