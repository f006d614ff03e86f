"""Moves bytes with NIXL. The only package that imports `nixl`."""

from kvstore.transfer.agent import JOIN_BYTES, Agent, PreparedList, Registration, Transfer, joined, paired

__all__ = ["JOIN_BYTES", "Agent", "PreparedList", "Registration", "Transfer", "joined", "paired"]
