"""The wire values of a worker's moves and checks, which the directory sends it: copies between its
tiers or into another worker's DRAM (`MoveRequest`), and whether replicas still hash to their
checksums (`VerifyRequest`). Pydantic models, like the rest of `kvstore.core.specs`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kvstore.core.spec_base import Spec
from kvstore.core.specs import MAX_BLOCKS, BlockBytes, Checksum, PageRun, TierKind


class MoveItem(Spec):
    """Directory -> worker: copy one block between two of the worker's tiers."""

    src_kind: TierKind
    src_runs: list[PageRun]
    dst_kind: TierKind
    dst_runs: list[PageRun]
    dst_token: str
    nbytes: int = Field(gt=0)
    checksum: Checksum = Field(description="what the bytes must hash to")
    namespace_id: str
    hash: str
    allocate: bool = Field(False, exclude_if=lambda v: not v, description="the worker picks the destination's "
                           "NVMe pages under dst_token (dst_runs empty) and reports them in MoveResult.dst_runs; "
                           "written only when true, so a worker from before reads the other moves")

    @model_validator(mode="after")
    def _allocated_here(self) -> MoveItem:
        if self.allocate and (self.dst_kind != "nvme" or self.dst_runs):
            raise ValueError("allocate: the worker picks NVMe pages only, and dst_runs must be empty")
        return self


class Peer(Spec):
    """Directory -> worker: another worker whose DRAM a move writes into (worker to worker, UCX)."""

    agent_name: str = Field(max_length=200)
    agent_metadata: str = Field(max_length=16 << 20, description="base64 of its NIXL agent metadata")
    base_addr: int = Field(ge=0, description="address of its DRAM arena")
    page_bytes: int = Field(gt=0)


class MoveRequest(Spec):
    items: list[MoveItem] = Field(min_length=1)
    peer: Peer | None = Field(None, description="every item goes to this worker's DRAM (dst_runs are its pages)")
    expires_at: float | None = Field(None, description="unix time after which the worker must not start "
                                     "writing: the directory holds the destinations until then, no longer")


MoveCode = Literal["ok", "source_corrupt", "failed", "expired", "unreachable"]


class MoveResult(Spec):
    ok: list[bool]
    errors: list[str | None]
    codes: list[MoveCode] = Field([], description="per item; source_corrupt: the source failed its checksum "
                                  "before the copy (that replica is bad), failed: anything else")
    dst_runs: list[list[PageRun] | None] = Field([], exclude_if=lambda v: not v, description="per item when any "
                                                 "item had `allocate`: the pages the worker took for it (held "
                                                 "under its token, copied or not), null where it took none; "
                                                 "written only then, so a directory from before reads the answer")

    @model_validator(mode="after")
    def _one_per_item(self) -> MoveResult:
        if len(self.errors) != len(self.ok) or any(values and len(values) != len(self.ok)
                                                   for values in (self.codes, self.dst_runs)):
            raise ValueError("errors, codes and dst_runs hold one value per item (codes and dst_runs may be empty)")
        return self


class FenceRequest(Spec):
    """Directory -> worker: moves whose answer the directory does not have (see worker/fencing.py)."""

    tokens: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(min_length=1, max_length=MAX_BLOCKS)


class FenceResult(Spec):
    settled: list[bool] = Field(description="per token; true: nothing writes under it here any more, and a "
                                "move under it that arrives later is refused")


class VerifyItem(Spec):
    """Directory -> worker: does the replica in these pages still hash to `checksum`?"""

    kind: TierKind
    runs: list[PageRun]
    nbytes: BlockBytes
    checksum: Checksum


class VerifyRequest(Spec):
    items: list[VerifyItem] = Field(min_length=1, max_length=MAX_BLOCKS)


class VerifyResult(Spec):
    matches: list[bool | None] = Field(description="per item; null: this worker cannot read that tier")
