"""Pooling models (embeddings, classification, scoring, reranking): what the engine needs of them below the
roles. `PoolingParams` (params.py), the runner and pooler choice from the model's files (config.py), the
built-in poolers (poolers.py), the worker's step over pooled hidden states (step.py), the outputs (outputs.py)
and the default pooling model from its PyPI package (default_model.py). The roles hook in thinly: the
scheduler finishes a pooling request after its prefill, the model runner pools instead of sampling, the
frontend and the server add the APIs (docs/pooling.md)."""
