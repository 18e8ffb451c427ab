"""Speculative decoding's worker parts: the built-in proposers and the rejection sampler (docs/speculative_decoding.md)."""
