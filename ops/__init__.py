"""Kernels, each with a torch reference beside it. Imported as `asyncengine.ops`; imports no engine code."""
