"""Thin vLLM adapter (see the vLLM plugin issue)."""
