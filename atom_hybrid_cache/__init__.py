"""Prefix caching for hybrid linear-attention models in vLLM."""

__version__ = "0.1.0"
