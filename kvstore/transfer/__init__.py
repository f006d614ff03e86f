"""Moves bytes with NIXL. The only package that imports `nixl`."""

from kvstore.transfer.agent import Agent, PreparedList, Registration, Transfer, paired

__all__ = ["Agent", "PreparedList", "Registration", "Transfer", "paired"]
