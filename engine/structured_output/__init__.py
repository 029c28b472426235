"""Structured output (guided decoding) on xgrammar: the request spec, its compile, the matchers."""

from pagedserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
