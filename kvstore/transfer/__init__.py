"""Moves bytes with NIXL. The only package that imports `nixl`."""

from kvstore.transfer.agent import Agent, Registration, Transfer

__all__ = ["Agent", "Registration", "Transfer"]
