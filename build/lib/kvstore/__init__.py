"""kvstore: a tiered KV-cache store for LLM inference."""

__version__ = "0.1.0"
