"""The eviction order's own process: `python -m kvstore.directory.moves.order_child`.

It holds each tier's eviction policy (`tier_policies.TierPolicies`, whose admission stays with the
directory) and answers the directory (`moves/order.py`) over its standard input and output: frames
of a 4-byte length and a pickle, read and answered in the order they come. Changes, hits and hints
need no answer; a build, an eviction and a dry run do. Building a tier's order from SQL and a dry
run's walk and re-check are tier-sized: here they hold this process's interpreter, not the one that
answers lookups, on a thread of the idle scheduling class. Its own connection reads the database (a SQLite file beside the directory's writer,
or PostgreSQL). It ends when its input closes: the directory went away.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, NamedTuple

from kvstore.core import heap
from kvstore.directory.db import engine as db
from kvstore.directory.db import moves as sql
from kvstore.directory.tier_policies import TierPolicies, block_key

log = logging.getLogger("kvstore.directory.order")
HEADER = struct.Struct("<I")


class TierSpec(NamedTuple):
    """What a tier's policies are made from."""
    id: int
    kind: str
    capacity_bytes: int | None
    page_bytes: int


def write_frame(out: BinaryIO, message) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(HEADER.pack(len(body)) + body)
    out.flush()


def read_frame(source: BinaryIO):
    """The next message, or None at the end of the input."""
    header = source.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body = source.read(size)
    return pickle.loads(body) if len(body) == size else None


class Order:
    """The policies and the database connection; one method per kind of message."""

    def __init__(self, eviction: dict[str, str], database_url: str) -> None:
        self.policies = TierPolicies(eviction, {kind: "always" for kind in eviction})
        self._engine = db.make_engine(database_url)
        self._sessions = db.make_sessions(self._engine)

    def close(self) -> None:
        self._engine.dispose()

    def expected(self, items: list) -> None:
        self.policies.keep_expected(items)

    def expect(self, tier: TierSpec, blocks: list) -> None:
        self.policies.expect(tier, blocks)

    def changed(self, changes: list) -> None:
        self.policies.changed(changes)

    def hits(self, hits: list) -> None:
        self.policies.hit_many(hits)

    def forget(self, tier_id: int) -> None:
        self.policies.forget(tier_id)

    def unbuild(self, tier: TierSpec) -> None:
        self.policies.unbuild(tier)

    def build(self, tier: TierSpec) -> list[tuple[str, int]]:
        """The tier's order from its READY replicas, unless built; the admission's keys of the blocks
        read before ((namespace/hash, hit count)), for the directory's admission to replay."""
        recorded: list[tuple[str, int]] = []

        def read_rows(fill) -> None:
            # a parent is found among the rows before it: the policy links a block only to a parent it
            # already holds, so a parent that comes later is no parent to it either way
            seen: dict[int, int] = {}  # hash((namespace, hash)) -> block id
            with self._sessions() as session:
                for chunk in sql.order_rows(session, tier.id):
                    rows = []
                    for block_id, namespace_id, block_hash, parent, hits in chunk:
                        seen[hash((namespace_id, block_hash))] = block_id
                        parent_id = seen.get(hash((namespace_id, parent))) if parent is not None else None
                        rows.append((block_id, parent_id, 0, None, None))
                        if hits:
                            recorded.append((block_key(namespace_id, block_hash), hits))
                    fill(rows)

        if not self.policies.built(tier):
            self.policies.build(tier, read_rows)
        return recorded

    def evict(self, tier: TierSpec, n: int, keep: set[int]) -> list[int] | None:
        return self.policies.evict(tier, n, keep)

    def dry_run(self, tier: TierSpec, limit: int, keep: set[int], to_free: int) -> tuple[int, int]:
        """(replicas, bytes) an eviction of up to `limit` blocks and `to_free` bytes would take now,
        re-checked in SQL (READY on the tier); the order is left as it is."""
        named = self.policies.peek(tier, limit, keep)
        if named is None:  # a policy that cannot tell without evicting: a copy of it evicts
            eviction = copy.deepcopy(self.policies.eviction_of(tier))
            named = eviction.evict(min(limit, max(0, len(eviction) - len(keep))), keep) or []
            while len(named) < limit and (one := eviction.evict(1, keep)):  # kept keys it does not hold
                named += one
            del eviction
            heap.give_back()  # the copy's memory, up to the size of the order itself
        with self._sessions() as session:
            found = sql.ready_replicas_of_blocks(session, tier.id, named)
        replicas = freed = 0
        for replica, _ in found:
            if freed >= to_free:
                break
            replicas, freed = replicas + 1, freed + replica.reserved_bytes
        return replicas, freed


ASKED = {"build", "evict", "dry_run"}  # the messages that are answered
TOLD = {"expected", "expect", "changed", "hits", "forget", "unbuild"}
TIER_SIZED = {"build", "dry_run"}  # run on a thread that gets a core only when no other process wants it


def _idle() -> None:
    """This thread runs only on a core nothing else wants (Linux: the policy is per thread). The
    other thread keeps its priority for what a save may wait on (the next victims, the changes): an
    unprivileged thread may not always return from the idle policy, so none ever switches back."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        log.warning("eviction order: tier-sized work at normal priority (%s)", exc)


def serve(source: BinaryIO, out: BinaryIO) -> None:
    """Messages until the input ends: the first ("start", eviction names, database URL), then
    (kind, request id, *arguments); an answer is (request id, True, value) or (request id, False,
    what went wrong)."""
    first = read_frame(source)
    if first is None or first[0] != "start":
        return
    order = Order(*first[1:])
    background = ThreadPoolExecutor(1, thread_name_prefix="order-idle", initializer=_idle)
    try:
        while (message := read_frame(source)) is not None:
            kind, request, *args = message
            if kind not in ASKED | TOLD:
                log.error("eviction order: unknown message %r", kind)
                continue
            try:
                call = getattr(order, kind)
                # in order all the same: the next message waits for the answer
                value = background.submit(call, *args).result() if kind in TIER_SIZED else call(*args)
            except Exception as exc:  # an answer either way: the directory falls back to SQL's order
                log.exception("eviction order: %s failed", kind)
                if kind in ASKED:
                    write_frame(out, (request, False, f"{type(exc).__name__}: {exc}"))
                continue
            if kind in ASKED:
                write_frame(out, (request, True, value))
    finally:
        background.shutdown()
        order.close()


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")  # the frames' own descriptor
    os.dup2(2, 1)  # whatever else prints to standard output lands in the log, not among the frames
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
