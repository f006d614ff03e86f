"""A namespace as operators see it: what it is and what the store holds of it."""

from __future__ import annotations

from kvstore.core.spec_base import Spec


class NamespaceInfo(Spec):
    namespace_id: str
    tenant: str
    model_id: str
    model_revision: str
    hash_scheme: str
    block_tokens: int
    block_nbytes: int
    write_through: bool
    replicas: int = 1  # workers that hold each block (DRAM or NVMe)
    blocks: dict[str, int]  # tier kind -> visible replicas
    bytes: dict[str, int]  # tier kind -> their bytes
