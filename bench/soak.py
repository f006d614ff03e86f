"""Soak with fault injection: the whole store under load while its infrastructure fails.

    .venv/bin/python bench/soak.py --minutes 10 [--seed 1] [--json bench/out/soak.json]

Three directory replicas on PostgreSQL (through a TCP proxy that can cut their connections),
three workers with DRAM, NVMe and S3 (moto), two engines saving and loading their prompts in a
loop (tests/fault/loop_engine.py: every load checked byte for byte). Faults are injected one at a
time, every kind once per cycle in a random order: SIGKILL and SIGSTOP/SIGCONT of a worker, of the leading replica and of a
follower; PostgreSQL restarted; every database connection cut; S3 down (moto restarted: its
objects are gone) or slow (the workers reach it through a proxy that delays every chunk); a
worker's NVMe disk full (its slabs live on a tmpfs of their own, filled up: only as root, where
mounting works; otherwise the kind is left out and the report says so). The engines' prompts fit
in DRAM, so during the last two an operator's eviction moves DRAM down to NVMe (and on to S3)
into the fault. After each fault the soak waits for recovery: every live replica's /readyz is
200 and each engine has loaded a whole prompt since the fault ended.

The checker reads the engines' histories at the end: every load is exact, partial (a verified
prefix) or a miss, never `wrong`; no call raised; then pins, leases, reservations and moves go
back to 0, every replica answers every prompt's lookup as the leader does, and each worker's
page accounting equals the directory's (NVMe pages the worker holds = the directory's used bytes;
DRAM pages granted = the directory's used bytes plus its free credit). The report: operations,
misses per fault window, faults by kind (injected, recovered, time to recover p50 and p99), and
what was lost (`wrong` loads and engine exceptions; target 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import print_table, write_json  # noqa: E402
from kvstore.core.errors import KVStoreError  # noqa: E402
from kvstore.core.specs import EvictRequest  # noqa: E402
from tests.fault.loop_engine import NAMESPACE, chains  # noqa: E402
from tests.helpers import MotoServer, PostgresCluster, Proxy, wait_until  # noqa: E402
from tests.stacks import ReplicaCluster, stop_engines  # noqa: E402

TTL_S, MOVE_TIMEOUT_S = 3.0, 15.0
PAUSE_S = (2.0, 6.0)  # between a recovery and the next fault
STOPPED_S = 5.0  # a SIGSTOPped process, or an outage, lasts this long
RECOVER_S = 90.0  # a fault not recovered from within this long counts as not recovered
BUCKET = "kv-soak"
S3_DELAY_S = 0.2  # per chunk forwarded while S3 is slow
NVME_FS_BYTES = 16 << 20  # a worker's NVMe tmpfs: its 8 MiB slab, the manifest, room to fill
FAULTS = ("worker_kill", "worker_stop", "leader_kill", "leader_stop", "follower_kill", "postgres_restart",
          "db_cut", "s3_outage", "s3_slow", "nvme_full")


class Soak:
    def __init__(self, tmp: Path, seed: int) -> None:
        self.tmp, self.rng = tmp, random.Random(seed)
        self.postgres = PostgresCluster().start()
        database_url = self.postgres.create_database()
        self.proxy = Proxy(self.postgres.port)  # the directories' way to the database
        proxied = database_url.replace(f":{self.postgres.port}/", f":{self.proxy.port}/")
        os.environ.update(MotoServer.CREDENTIALS)  # the workers find them like any AWS credentials
        self.moto = MotoServer(tmp / "moto.log").start()
        self.moto.client().create_bucket(Bucket=BUCKET)
        self.s3_proxy = Proxy(self.moto.port)  # the workers' way to S3
        self.cluster = ReplicaCluster(tmp, proxied, f"http://127.0.0.1:{self.s3_proxy.port}", BUCKET, TTL_S,
                                      MOVE_TIMEOUT_S)
        self.mounted = [tmp / f"nvme-{i}" for i in range(3) if _tmpfs(tmp / f"nvme-{i}")]
        self.kinds = FAULTS if len(self.mounted) == 3 else tuple(k for k in FAULTS if k != "nvme_full")
        self.engines: list[tuple[object, Path]] = []
        self.faults: list[dict] = []

    def start(self) -> None:
        self.cluster.start()
        self.engines = [self.cluster.engine(self.cluster.urls, seed) for seed in (1, 2)]
        wait_until(lambda: all((m / "ready").exists() for _, m in self.engines), 120, "a first round by each engine")

    # ---- faults ---------------------------------------------------------------------------------

    def inject(self, kind: str) -> tuple[float, float]:
        """Inject one fault; returns (when it began, when it ended)."""
        c, began = self.cluster, time.time()
        if kind in ("worker_kill", "worker_stop"):
            name = self.rng.choice(sorted(c.workers))
            proc = c.workers[name]
            if kind == "worker_kill":
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                c.start_worker(int(name[1:]))
            else:
                self._stopped(proc)
        elif kind in ("leader_kill", "leader_stop", "follower_kill"):
            leader = self._leader()
            i = leader if kind != "follower_kill" else self.rng.choice([j for j in c.live() if j != leader])
            if kind == "leader_stop":
                self._stopped(c.replicas[i])
            else:
                c.kill_replica(i)
                c.start_replica(i, wait=False)
        elif kind == "postgres_restart":
            self.postgres.restart()
        elif kind == "db_cut":
            self.proxy.cut()
            time.sleep(STOPPED_S)
            self.proxy.restore()
        elif kind == "s3_outage":
            self.moto.stop()
            time.sleep(STOPPED_S)
            self.moto.start()  # same port, empty again: the operator recreates the bucket
            self.moto.client().create_bucket(Bucket=BUCKET)
        elif kind == "s3_slow":
            self.s3_proxy.delay_s = S3_DELAY_S
            self._demote("dram", "nvme")  # the engines' prompts fit in DRAM: moves to S3 happen now
            time.sleep(STOPPED_S)
            self.s3_proxy.delay_s = 0.0
        elif kind == "nvme_full":
            filler = self.rng.choice(self.mounted) / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)  # until ENOSPC
            self._demote("dram")
            time.sleep(STOPPED_S)
            filler.unlink()
        return began, time.time()

    def _demote(self, *kinds: str) -> None:
        """An operator's eviction of each tier one tier down (what pressure would do): the moves run
        into the fault. Refused or failed moves are the fault's effect, not the soak's concern."""
        for kind in kinds:
            try:
                self.cluster.client(self._leader()).evict_tier(EvictRequest(tier=kind, limit=256))
            except (KVStoreError, TimeoutError) as exc:
                print(f"  evict {kind} during the fault: {exc}", flush=True)

    def _stopped(self, proc) -> None:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(STOPPED_S)
        proc.send_signal(signal.SIGCONT)

    def _leader(self) -> int:
        wait_until(lambda: self.cluster.leader() is not None, 60, "a leader")
        return self.cluster.leader()

    def recovered(self, ended: float) -> float | None:
        """Seconds from the fault's end until every live replica is ready and each engine has loaded
        a whole prompt since; None if not within RECOVER_S. A replica that lost the lead while it
        could not reach the database steps down and follows again by itself: nothing restarts it."""
        def ready() -> bool:
            if not self.replicas_ready():
                return False
            return all(_last_exact(m) > ended for _, m in self.engines)
        try:
            wait_until(ready, RECOVER_S, "recovery")
        except TimeoutError:
            return None
        return time.time() - ended

    def replicas_ready(self) -> bool:
        """Every live replica answers /readyz with 200."""
        for i in self.cluster.live():
            try:
                if httpx.get(self.cluster.url(i) + "/readyz?workers=0", timeout=2).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    # ---- the checker --------------------------------------------------------------------------------

    def finish(self) -> dict:
        for _, markers in self.engines:
            (markers / "stop").touch()
        wait_until(self.replicas_ready, RECOVER_S, "every replica ready")
        histories = []
        for seed, (proc, _) in zip((1, 2), self.engines):
            assert proc.wait(timeout=300) == 0, (self.tmp / f"engine-{seed}.log").read_text()[-3000:]
            histories.append(json.loads((self.tmp / f"engine-{seed}.json").read_text()))
        settled = self._settled()
        return {"histories": histories, "settled": settled, "replicas_agree": self._replicas_agree(),
                "pages_agree": self._pages_agree()}

    def _settled(self) -> bool:
        client = self.cluster.client(self._leader())
        try:
            wait_until(lambda: (lambda s: (s.pins, s.leases_active, s.reservations, s.inflight_moves)
                                == (0, 0, 0, 0))(client.stats()), 60, "no pins, leases, reservations or moves")
            return True
        except TimeoutError:
            return False

    def _replicas_agree(self) -> bool:
        """Every live replica answers every prompt's lookup as the leader does (their indexes agree)."""
        prompts = chains(1) + chains(2)

        def answers(i: int) -> list[int] | None:
            client = self.cluster.client(i)
            try:
                return [client.lookup(NAMESPACE.namespace_id, chain).num_hit_blocks for chain in prompts]
            except KVStoreError:
                return None
        try:
            wait_until(lambda: len({str(answers(i)) for i in self.cluster.live()} - {"None"}) == 1
                       and self.replicas_ready(), 30, "replicas agree")
            return True
        except TimeoutError:
            return False

    def _pages_agree(self) -> bool:
        """Each worker's page accounting equals the directory's: NVMe pages the worker holds are the
        directory's used bytes; the DRAM pages it granted are the directory's used bytes plus its
        free credit. A mismatch is a leak on one side."""
        def agree() -> bool:
            client = self.cluster.client(self._leader())
            tiers = {(t.worker, t.kind): t for t in client.tiers()}
            for worker in client.workers():
                held = _held_bytes(worker.control_url)
                for kind in ("dram", "nvme"):
                    t = tiers.get((worker.name, kind))
                    directory = t.used_bytes + (t.credit_free_bytes or 0) if t else 0
                    if held.get(kind, 0) != directory:
                        self.mismatch = f"{worker.name} {kind}: worker holds {held.get(kind)}, directory {directory}"
                        return False
            return True
        self.mismatch = ""
        try:
            wait_until(agree, 30, "page accounting agrees")
            return True
        except TimeoutError:
            print("page accounting differs:", self.mismatch, flush=True)
            return False

    def close(self) -> None:
        self.cluster.close()
        stop_engines()
        self.moto.stop()
        self.proxy.cut()
        self.s3_proxy.cut()
        self.postgres.stop()
        for path in self.mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _tmpfs(path: Path) -> bool:
    """A small tmpfs of its own at `path` (a disk that can be filled); False where mounting fails."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={NVME_FS_BYTES}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _held_bytes(control_url: str) -> dict[str, int]:
    """tier -> bytes the worker's pages hold, from its /metrics."""
    text = httpx.get(control_url.rstrip("/") + "/metrics", timeout=5).text
    return {m[1]: int(float(m[2])) for m in re.finditer(r'kvstore_worker_tier_held_bytes\{tier="(\w+)"\} (\S+)', text)}


def _last_exact(markers: Path) -> float:
    try:
        return float((markers / "last_exact").read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def report(faults: list[dict], outcome: dict, minutes: float) -> dict:
    events = [(h["started_at"] + e[0], e) for h in outcome["histories"] for e in h["events"]]
    loads = [e for _, e in events if e[1] == "load"]
    by_outcome = {k: sum(e[2] == k for e in loads) for k in ("exact", "partial", "miss", "wrong")}
    errors = sum(len(h["errors"]) for h in outcome["histories"])
    kinds = {}
    for fault in faults:
        k = kinds.setdefault(fault["kind"], {"injected": 0, "recovered": 0, "recover_s": [], "misses": 0})
        k["injected"] += 1
        if fault["recover_s"] is not None:
            k["recovered"] += 1
            k["recover_s"].append(fault["recover_s"])
        window_end = fault["ended"] + (fault["recover_s"] if fault["recover_s"] is not None else RECOVER_S)
        k["misses"] += sum(1 for t, e in events if e[1] == "load" and e[2] in ("miss", "partial")
                           and fault["began"] <= t <= window_end)
    for k in kinds.values():
        times = sorted(k.pop("recover_s"))
        k["recover_p50_s"] = round(statistics.median(times), 2) if times else None
        k["recover_p99_s"] = round(times[min(len(times) - 1, int(0.99 * len(times)))], 2) if times else None
    return {"minutes": minutes, "operations": len(events), "loads": by_outcome, "engine_errors": errors,
            "lost": by_outcome["wrong"] + errors, "settled": outcome["settled"],
            "replicas_agree": outcome["replicas_agree"], "pages_agree": outcome["pages_agree"], "faults": kinds,
            "all_recovered": all(f["recover_s"] is not None for f in faults)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    p.add_argument("--seed", type=int, default=1, help="the faults' random order")
    p.add_argument("--json", default="bench/out/soak.json")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    soak = Soak(tmp, args.seed)
    try:
        soak.start()
        deadline, order = time.time() + args.minutes * 60, []
        while time.time() < deadline:
            time.sleep(soak.rng.uniform(*PAUSE_S))
            if not order:  # every kind once per cycle, in a random order
                order = soak.rng.sample(soak.kinds, len(soak.kinds))
            kind = order.pop()
            began, ended = soak.inject(kind)
            recover_s = soak.recovered(ended)
            soak.faults.append({"kind": kind, "began": began, "ended": ended, "recover_s": recover_s})
            print(f"{kind}: {'recovered in %.1f s' % recover_s if recover_s is not None else 'NOT recovered'}",
                  flush=True)
        result = report(soak.faults, soak.finish(), args.minutes)
        result["not_injected"] = sorted(set(FAULTS) - set(soak.kinds))
    finally:
        soak.close()
    result["logs"] = str(tmp)
    write_json(args.json, result)
    print_table(["fault", "injected", "recovered", "recover p50 s", "recover p99 s", "misses in window"],
                [[kind, k["injected"], k["recovered"], k["recover_p50_s"], k["recover_p99_s"], k["misses"]]
                 for kind, k in sorted(result["faults"].items())])
    print(f"operations {result['operations']}, loads {result['loads']}, engine errors {result['engine_errors']}, "
          f"lost {result['lost']}, settled {result['settled']}, replicas agree {result['replicas_agree']}, "
          f"pages agree {result['pages_agree']}"
          + (f", not injected here: {', '.join(result['not_injected'])}" if result["not_injected"] else ""))
    sys.exit(0 if result["lost"] == 0 and result["all_recovered"] and result["settled"]
             and result["replicas_agree"] and result["pages_agree"] else 1)


if __name__ == "__main__":
    main()
