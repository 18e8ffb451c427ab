"""The request-side spec moved to the floor, asyncengine/structured_output_spec.py (sampling_params and the
wire carry it); the names stay importable from here for the modules that still use this path."""

from asyncengine.structured_output_spec import KINDS, GrammarSpec, StructuredOutputsParams

__all__ = ["KINDS", "GrammarSpec", "StructuredOutputsParams"]
