"""Prometheus metrics of a storage worker (names prefixed `kvstore_worker_`), served on its control
port at GET /metrics: what its tiers hold and what its moves between tiers did."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from kvstore import __version__

MOVE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        self.build_info = Gauge("kvstore_build_info", "kvstore's version and Python's (always 1)",
                                ["version", "python"], registry=r)
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.tier_capacity = Gauge("kvstore_worker_tier_capacity_bytes", "Capacity of a tier with pages",
                                   ["tier"], registry=r)
        self.tier_held = Gauge("kvstore_worker_tier_held_bytes", "Bytes of a tier's pages the directory holds: "
                               "page credit it was granted (all of DRAM, soon after start), reservations and "
                               "replicas; how much holds blocks is the directory's kvstore_tier_used_bytes",
                               ["tier"], registry=r)
        self.moves = Counter("kvstore_worker_moves", "Blocks moved between this worker's tiers, by route "
                             "(src_dst, as the directory's kvstore_move_failures) and result (ok, failed, source_corrupt, expired)", ["route", "result"],
                             registry=r)
        self.moved_bytes = Counter("kvstore_worker_moved_bytes", "Bytes of the blocks moved successfully",
                                   ["route"], registry=r)
        self.move_seconds = Histogram("kvstore_worker_move_seconds", "Time to serve one move request's blocks "
                                      "of one route", ["route"], buckets=MOVE_BUCKETS, registry=r)
        self.checksum_failures = Counter("kvstore_worker_checksum_failures", "Blocks whose bytes did not hash to "
                                         "their checksum, by the tier they were read from", ["tier"], registry=r)
        self.s3_errors = Counter("kvstore_worker_s3_errors", "Moves to or from S3 that failed or were refused "
                                 "because S3 was unreachable", ["reason"], registry=r)
        self.nixl_failures = Counter("kvstore_worker_nixl_failures", "NIXL transfer requests that failed or "
                                     "timed out, by remote memory type (FILE, OBJ, VRAM, DRAM)", ["mem"], registry=r)
        self.share_errors = Counter("kvstore_worker_arena_share_errors", "Hand-overs of the DRAM arena to a "
                                    "same-host engine that failed, by reason (accept: accept() failed, e.g. out "
                                    "of file descriptors; too_many_engines: refused, the engine uses NIXL)",
                                    ["reason"], registry=r)
        self.control_requests = Counter("kvstore_worker_control_requests", "Control calls answered, by path and "
                                        "status", ["path", "status"], registry=r)

    def render(self, tiers: dict[str, tuple[int, int]]) -> bytes:
        """`tiers`: kind -> (capacity bytes, held bytes) of every tier with pages, read now."""
        for kind, (capacity, held) in tiers.items():
            self.tier_capacity.labels(kind).set(capacity)
            self.tier_held.labels(kind).set(held)
        return generate_latest(self.registry)
