"""Moves bytes with NIXL. The only package that imports `nixl`."""

from kvstore.transfer.agent import Agent, PreparedList, Registration, Transfer
from kvstore.transfer.rows import JOIN_BYTES, joined, paired

__all__ = ["JOIN_BYTES", "Agent", "PreparedList", "Registration", "Transfer", "joined", "paired"]
