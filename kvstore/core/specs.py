"""The wire values exchanged between connector, directory and worker: pydantic models, so the
directory validates every body it receives and the client parses every answer it gets with the
same definitions. Hashes travel as lowercase hex; NIXL agent metadata as base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from kvstore.core.keys import MAX_BLOCK_BYTES
from kvstore.core.push import PushGrant
from kvstore.core.spec_base import Spec

TierKind = Literal["hbm", "dram", "nvme", "s3"]
HEX_HASH = r"^[0-9a-f]{2,128}$"
HexHash = Annotated[str, Field(pattern=HEX_HASH)]
Checksum = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]  # xxh3_64 of a block, 16 lowercase hex digits
BlockBytes = Annotated[int, Field(gt=0, le=MAX_BLOCK_BYTES)]
NamespaceId = Annotated[str, Field(max_length=16, description="16 hex digits, as POST /v1/namespaces answered")]
MAX_BLOCKS = 100_000  # hashes one request may name (in all its lists together), or cause (token ids)
MAX_TOKEN_IDS = 1 << 20  # token ids of one /v1/lookup/tokens request


def _at_most_blocks(lists: list[list[str]], what: str) -> list[list[str]]:
    if sum(len(x) for x in lists) > MAX_BLOCKS:
        raise ValueError(f"at most {MAX_BLOCKS} hashes in all {what} together")
    return lists


class TierSpec(Spec):
    """A tier as a worker announces it at registration. `device` here and in a ReplicaLocation is written only
    when it is not 0: a directory or an engine from before the field refuses fields it does not know."""

    kind: TierKind
    capacity_bytes: int | None = Field(ge=0, lt=1 << 62, description="null = unbounded")
    page_bytes: int = Field(gt=0, le=MAX_BLOCK_BYTES)
    base_addr: int = Field(0, ge=0, lt=1 << 63, description="address of page 0 in the worker's address space")
    device: int = Field(0, ge=0, lt=1 << 16, exclude_if=lambda d: not d, description="an HBM tier's CUDA device")
    high_watermark: float = Field(0.95, gt=0, le=1)
    low_watermark: float = Field(0.85, gt=0, le=1)


class PageRun(Spec):
    """`count` pages starting at page `first`."""

    first: int = Field(ge=0, lt=1 << 40)
    count: int = Field(gt=0, lt=1 << 40)

    @field_validator("first", "count", mode="before")
    @classmethod
    def _not_a_bool(cls, value):
        if isinstance(value, bool):  # JSON's false is not page 0
            raise ValueError("a page number, not a boolean")
        return value


def page_spans(base: int, page_bytes: int, runs, nbytes: int) -> list[tuple[int, int]]:
    """(address, length) of the first `nbytes` of these pages; runs are PageRuns or [first, count]."""
    spans, left = [], nbytes
    for run in runs:
        first, count = (run.first, run.count) if isinstance(run, PageRun) else run
        length = min(count * page_bytes, left)
        spans.append((base + first * page_bytes, length))
        left -= length
    assert left == 0, "pages do not cover the block"
    return spans


class Survivor(Spec):
    """A replica found on a durable tier when a worker starts (restart recovery)."""

    kind: TierKind
    token: str = Field(max_length=64)
    runs: list[PageRun] = Field(max_length=1 << 16)
    namespace_id: str = Field(max_length=64)
    hash: str = Field(pattern=HEX_HASH)
    nbytes: BlockBytes
    checksum: str | None = Field(None, description="None: unknown (S3 listings); such blocks are not adopted")


class WorkerRegistration(Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$", description="letters, digits, . _ -")
    agent_name: str = Field(pattern=r"^[!-~]{1,200}$")
    agent_metadata: str = Field(min_length=4, max_length=16 << 20, pattern=r"^(?:[A-Za-z0-9+/]{4})+$|^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$",
                                description="base64 of the NIXL agent metadata")
    control_url: str = Field(pattern=r"^(https?://[A-Za-z0-9._~%:\[\]-]+/?)?$", max_length=500,
                             description="the worker's control endpoint, an http(s) origin; empty: a worker "
                             "the directory cannot call (no tier moves, no checks of written bytes)")
    pid: int = Field(0, ge=0, lt=1 << 31)
    backends: list[Annotated[str, Field(max_length=32)]] = Field([], max_length=16)
    tiers: list[TierSpec] = Field(min_length=1, max_length=4, description="at most one tier of each kind")
    inventory: list[Survivor] = Field([], max_length=1 << 24, description="what survived on durable tiers")
    control_secret: str | None = Field(None, min_length=32, max_length=128, description="directory calls carry it")


class Registered(Spec):
    worker: str
    epoch: int
    heartbeat_interval_s: float


class Heartbeat(Spec):
    epoch: int


class WorkerInfo(Spec):
    name: str
    agent_name: str
    epoch: int
    state: str
    pid: int
    control_url: str
    backends: list[str]
    last_heartbeat: float
    agent_metadata: str | None = None


class ReplicaLocation(Spec):
    """Where a replica's bytes are: absolute (addr, nbytes) runs in a worker's memory."""

    worker: str
    epoch: int
    agent_name: str
    tier: TierKind
    runs: list[tuple[int, int]]
    device: int = Field(0, ge=0, lt=1 << 16, exclude_if=lambda d: not d, description="an HBM tier's CUDA device")


class BlockToStore(Spec):
    hash: str = Field(pattern=HEX_HASH)
    parent: str | None = Field(None, pattern=HEX_HASH)
    nbytes: BlockBytes


class RequestHints(Spec):
    """What an engine says about a save's request, for the eviction and admission policies.
    Advisory: a missing or wrong hint costs hit ratio, never correctness."""

    session_id: str | None = Field(None, max_length=256, description="the conversation the request belongs to")
    retain: Literal["turn", "session", "none"] | None = Field(None, description="turn: the next turn of this "
                                                             "conversation is expected soon; session: it may "
                                                             "continue; none: nothing of it is expected to be "
                                                             "read again by its sender")
    priority: int = Field(0, ge=-100, le=100, description="above 0: keep longer; below 0: evict sooner")


class PrepareStore(Spec):
    namespace_id: NamespaceId
    blocks: list[BlockToStore] = Field(min_length=1, max_length=MAX_BLOCKS)
    writer: str = Field("", max_length=200)
    hosts: list[Annotated[str, Field(max_length=255)]] = Field([], max_length=16, description="the engine's "
                                                               "host names and addresses: its workers come first")
    hints: RequestHints | None = None


StoreStatus = Literal["admitted", "exists", "in_progress", "rejected"]


class StoreDecision(Spec):
    hash: str
    status: StoreStatus
    reason: str | None = None  # rejected: no_worker, no_space, not_admitted, throttled, parent_rejected
    retry_after_s: float | None = None  # throttled: ask again after this
    location: ReplicaLocation | None = None


class StorePrepared(Spec):
    token: str | None = Field(description="reservation token; null when nothing was admitted")
    expires_at: float | None = None
    blocks: list[StoreDecision]


class BlockWritten(Spec):
    hash: str = Field(pattern=HEX_HASH)
    ok: bool
    checksum: Checksum | None = None


class CompleteStore(Spec):
    token: str = Field(max_length=64)
    blocks: list[BlockWritten] = Field(max_length=MAX_BLOCKS)


class StoreCompleted(Spec):
    committed: int
    rolled_back: int


class TokenBody(Spec):
    token: str = Field(max_length=64)


class LookupRequest(Spec):
    namespace_id: NamespaceId
    hashes: list[HexHash] = Field(max_length=MAX_BLOCKS)
    locations: bool = Field(False, description="also answer each hit block's replica location and checksum")


class LookupBatchRequest(Spec):
    namespace_id: NamespaceId
    prompts: list[list[HexHash]] = Field(max_length=4096)

    _bounded = field_validator("prompts")(lambda lists: _at_most_blocks(lists, "prompts"))


class BlockHit(Spec):
    hash: str
    nbytes: int
    checksum: str
    location: ReplicaLocation


class LookupResult(Spec):
    num_hit_blocks: int
    blocks: list[BlockHit] = Field([], description="the hits, only when the request asked for locations")
    by_tier: dict[str, int]
    tier_runs: list[tuple[str, int]] = Field([], description="the hits' tier kinds in prefix order, run-length "
                                             "encoded: [[kind, blocks], ...]")

    def tiers(self) -> list[str]:
        """The tier kind of each hit, in prefix order."""
        return [kind for kind, n in self.tier_runs for _ in range(n)]


class LookupBatchResult(Spec):
    results: list[LookupResult]


class TokenLookupRequest(Spec):
    namespace_id: NamespaceId
    token_ids: list[int] = Field(max_length=MAX_TOKEN_IDS, description=f"at most {MAX_TOKEN_IDS}, and at most "
                                 f"{MAX_BLOCKS} blocks of the namespace's block_tokens")
    hash_seed: str | None = Field(None, max_length=256, description="vLLM namespaces: the engines' PYTHONHASHSEED")


class TokenLookupResult(Spec):
    hit_tokens: int
    num_hit_blocks: int
    block_tokens: int


class PrepareLoad(Spec):
    namespace_id: NamespaceId
    hashes: list[HexHash] = Field(max_length=MAX_BLOCKS)
    reader: str = Field("", max_length=200)
    push: bool = Field(False, exclude_if=lambda v: not v, description="grant the reader pushes of its DRAM hits "
                       "by their workers (needs a reader)")


class LoadPrepared(Spec):
    token: str | None
    expires_at: float | None
    blocks: list[BlockHit]
    more: int = Field(0, description="blocks after these that are stored in a tier below but could not be "
                      "staged into memory now (the memory tier is full): load these, complete, then ask again")
    grants: list[PushGrant] = Field([], exclude_if=lambda v: not v, description="with push: per worker holding "
                                    "DRAM hits, what lets it push them into the reader's memory")


class PrepareLoads(Spec):
    """Several prefixes leased at once (an engine step's loads): one token, each block pinned once."""
    namespace_id: NamespaceId
    chains: list[list[HexHash]] = Field(max_length=4096)
    reader: str = Field("", max_length=200)

    _bounded = field_validator("chains")(lambda lists: _at_most_blocks(lists, "chains"))


class LoadsPrepared(Spec):
    token: str | None  # null when no chain had a hit
    expires_at: float | None
    chains: list[list[BlockHit]]  # the leading hits of each chain, in the request's order
    more: list[int] = []  # per chain: as LoadPrepared.more


class BlockRead(Spec):
    hash: HexHash
    ok: bool


class CompleteLoad(Spec):
    token: str = Field(max_length=64)
    blocks: list[BlockRead] = Field([], max_length=MAX_BLOCKS, description="blocks whose bytes did not match "
                                     "their checksum (ok: false), whose replicas are invalidated; a block not "
                                     "listed was read well")


class LoadCompleted(Spec):
    released: int
    invalidated: int


class TierUsage(Spec):
    worker: str
    kind: TierKind
    capacity_bytes: int | None
    used_bytes: int
    num_blocks: int
    kv_bytes: int = Field(0, description="KV bytes of the blocks held (visible replicas)")
    block_bytes: int = Field(0, description="bytes of the pages those blocks take")
    page_bytes: int
    high_watermark: float
    low_watermark: float
    credit_free_bytes: int | None = Field(None, description="memory tiers: free bytes of the page credit this "
                                          "directory holds (pages the worker granted it)")

    @property
    def efficiency(self) -> float | None:
        """KV bytes held ÷ bytes of the pages they take (1.0: no page is partly empty)."""
        return self.kv_bytes / self.block_bytes if self.block_bytes else None


class Stats(Spec):
    blocks: int
    replicas: int
    reservations: int  # replicas being written: engine stores and move destinations
    leases_active: int
    pins: int
    workers_active: int
    inflight_moves: int = 0  # source replicas being copied to another tier
    replicas_by_tier: dict[str, int] = Field(default_factory=dict)  # visible replicas per tier kind
    indexed_blocks: int = 0  # blocks the lookup index holds
    commit_groups: int = 0  # group commits since start
    committed_jobs: int = 0  # jobs those commits carried (jobs / groups: how much grouping helps)
    leader: bool = True  # this directory replica writes (the others forward to it)
    follower_lag_s: float = 0.0  # a follower: seconds since it last read the leader's change log
    term: int = 0  # the leading replica's term, as the database says (raised by each new leader)


class Renewed(Spec):
    token: str
    expires_at: float


class EvictRequest(Spec):
    """Without `tier`: drop every replica (of one namespace, or all). With `tier`: least recently
    used blocks of that tier go one tier down (dropped at the bottom), up to `bytes` or `limit`."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["tier"], "properties": {"tier": {"type": "string"}}},
        {"required": ["namespace_id"], "properties": {"namespace_id": {"type": "string"}}},
        {"required": ["all"], "properties": {"all": {"const": True}}}]})

    tier: TierKind | None = None
    worker: str | None = Field(None, description="null = every worker with that tier")
    namespace_id: str | None = Field(None, description="null = every namespace")
    bytes: int | None = Field(None, gt=0, description="null = no byte limit")
    limit: int = Field(256, gt=0, le=100_000, description="at most this many blocks per call")
    dry_run: bool = Field(False, description="answer what would be evicted; change nothing")
    all: bool = Field(False, description="without tier and namespace_id: every replica of every namespace, "
                      "S3 included; refused unless said")


class Evicted(Spec):
    replicas: int
    bytes: int = 0
    demoted: int = 0
    dropped: int = 0


class NamespacePolicy(Spec):
    """How the directory keeps a namespace's blocks; does not change its keys."""

    write_through: bool = Field(False, description="also keep a copy of every block in S3, for durability")
    replicas: int = Field(1, ge=1, le=3, description="workers that hold each block in DRAM or NVMe (copies are "
                          "made in the background), so that losing one worker loses no prefix")
