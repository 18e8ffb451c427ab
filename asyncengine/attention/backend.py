"""AttentionBackend, the interface every attention backend implements: in the floor,
asyncengine.interfaces.attention (its docstring says what a backend is given and returns); imported
here for the name code and plugins have used."""

from __future__ import annotations

from asyncengine.interfaces.attention import AttentionBackend

__all__ = ["AttentionBackend"]
