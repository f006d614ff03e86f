"""Typed HTTP clients: of the directory (used by connector, worker and CLI) and of a
worker's control endpoint (used by the directory)."""

from kvstore.client.directory import DirectoryClient

__all__ = ["DirectoryClient"]
