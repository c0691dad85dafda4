"""Folio: an LLM serving cluster built around PagedAttention."""
__version__ = "0.1.0"
