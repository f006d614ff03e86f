"""What `kvstore inspect` asks and is told: a prefix's blocks, where their replicas are, who pins them."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from kvstore.core.spec_base import Spec
from kvstore.core.specs import MAX_TOKEN_IDS, HexHash

MAX_INSPECTED = 4096  # blocks one inspection may name
HashSeed = Field(None, max_length=256, description="vLLM namespaces: the engines' PYTHONHASHSEED, if they set one")


class InspectRequest(Spec):
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["token_ids"], "properties": {"token_ids": {"type": "array"}},
         "not": {"required": ["hashes"], "properties": {"hashes": {"type": "array"}}}},
        {"required": ["hashes"], "properties": {"hashes": {"type": "array"}},
         "not": {"required": ["token_ids"], "properties": {"token_ids": {"type": "array"}}}}]})

    namespace_id: str = Field(max_length=64)
    token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_IDS, description="a prompt, hashed with the "
                                        "namespace's own scheme (vLLM's included)")
    hashes: list[HexHash] | None = Field(None, max_length=MAX_INSPECTED, description="or its block hashes")
    hash_seed: str | None = HashSeed

    @model_validator(mode="after")
    def _one_of(self) -> "InspectRequest":
        if (self.token_ids is None) == (self.hashes is None):
            raise ValueError("give token_ids or hashes, not both")
        return self


class ReplicaInfo(Spec):
    worker: str
    tier: str
    state: str
    epoch: int
    nbytes: int
    pins: int = Field(description="reader leases holding it now")


class BlockInfo(Spec):
    position: int = Field(description="the block's index in the prefix")
    hash: str
    stored: bool
    nbytes: int | None = None
    hit_count: int | None = None
    last_access: float | None = None
    replicas: list[ReplicaInfo] = []


class InspectResult(Spec):
    namespace_id: str
    block_tokens: int
    blocks: list[BlockInfo]
