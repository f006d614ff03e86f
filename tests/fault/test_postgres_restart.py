"""PostgreSQL restarted under two directory replicas, one worker and an engine that knows both
replicas' URLs (issue 45, defect 12): the server is stopped at once (`pg_ctl -m immediate`, a
crash to every connection) and started again 3 s later, twice.

After each restart saves and lookups resume, the prefixes saved before load byte-exact, both
replicas are ready again (the one that led before and lost its lock with its connection rejoins
as a leader or a follower; it does not stay out), and a worker SIGKILLed afterwards is `dead`
on every replica within its heartbeat timeout: no replica serves the worker state it had before
the restart. Which replica leads afterwards is a race (the old leader takes its lock back, or the
other replica takes it first and the old one steps down); runs see both, and print which."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import numpy as np
import pytest

from kvstore.client import DirectoryClient
from kvstore.connector import KVStoreClient
from tests.fault.conftest import TTL_S
from tests.fault.prompts import BLOCKS_PER_PROMPT, NS, load, prompt, save
from tests.helpers import PostgresCluster, free_port, kvstore_cmd, spawn, stop, wait_http, wait_until

pytestmark = pytest.mark.postgres
DOWN_S = 3.0  # the database is away this long
HEARTBEAT_S = TTL_S  # a worker silent this long is dead (shorter than the outage: it must not count)
READY_S = 20.0  # after the database is back, every replica answers /readyz 200 within this
RESUMED_S = 20.0  # ... and saves and loads work again within this
SHORT_S = 5.0  # a call refused by a replica that has not caught up is retried this long
DEAD_MARGIN_S = 3.0  # a reaper round, a forwarded call, a poll: on top of the heartbeat timeout


class TwoReplicas:
    """Two directory replicas on one PostgreSQL database and one worker that knows both, as processes."""

    def __init__(self, tmp, database_url: str) -> None:
        self.tmp, self.database_url = tmp, database_url
        self.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.replicas: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None
        self.worker_runs = 0

    def start(self) -> None:
        for i, url in enumerate(self.urls):  # one after the other: the first leads
            self.replicas.append(spawn(kvstore_cmd(
                "directory", "serve", "--insecure-no-auth", "--port", url.rsplit(":", 1)[1], "--database-url",
                self.database_url, "--lease-ttl", str(TTL_S), "--heartbeat-timeout", str(HEARTBEAT_S)),
                self.tmp / f"directory-{i}.log", env={"KVSTORE_RESERVATION_TTL_S": str(TTL_S)}))
            wait_http(url + "/readyz?workers=0", proc=self.replicas[-1])
        self.start_worker()

    def start_worker(self) -> None:
        """The worker w0, registered (again: a new epoch) and active on every replica."""
        self.worker_runs += 1
        before = self.epoch()
        self.worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", ",".join(self.urls), "--name", "w0",
                                        "--dram-bytes", "16MiB", "--page-bytes", "16KiB"),
                            self.tmp / f"worker-{self.worker_runs}.log")
        wait_until(lambda: all(self.state(url) == "active" for url in self.urls) and self.epoch() > before, 60,
                   "w0 active under a new epoch")

    def state(self, url: str) -> str | None:
        """w0's state as replica `url` answers /v1/workers (None: it does not answer, or knows no w0)."""
        try:
            return next((w.state for w in DirectoryClient(url, timeout_s=5).workers() if w.name == "w0"), None)
        except Exception:  # noqa: BLE001 (a replica that does not answer says nothing about w0)
            return None

    def epoch(self) -> int:
        try:
            return next((w.epoch for w in DirectoryClient(self.urls, timeout_s=5).workers() if w.name == "w0"), 0)
        except Exception:  # noqa: BLE001 (the directory is still coming up)
            return 0

    def settled(self) -> bool:
        """Both replicas answer /readyz 200 and exactly one leads (so the one that lost its lock has
        noticed: a worker killed from here on is the leader's to declare dead)."""
        try:
            return self.readyz() == [200, 200] and \
                sum(DirectoryClient(url, timeout_s=5).stats().leader for url in self.urls) == 1
        except Exception:  # noqa: BLE001 (a replica that does not answer has not settled)
            return False

    def readyz(self) -> list[int]:
        answers = []
        for url in self.urls:
            try:
                answers.append(httpx.get(url + "/readyz", timeout=5).status_code)
            except httpx.HTTPError:
                answers.append(0)
        return answers

    def log_tail(self, lines: int = 30) -> str:
        text = []
        for i in range(len(self.urls)):
            log = (self.tmp / f"directory-{i}.log").read_text(errors="replace").splitlines()
            text += [f"--- directory-{i}"] + [line for line in log if " INFO " not in line][-lines:]
        return "\n".join(text)

    def close(self) -> None:
        for proc in [self.worker, *self.replicas]:
            if proc is not None:
                stop(proc)


@pytest.fixture
def database():
    cluster = PostgresCluster().start()  # its own server: this test stops it
    yield cluster
    cluster.stop()


def saved_whole(client: KVStoreClient, seed: int) -> bool:
    return save(client, *prompt(seed)) == BLOCKS_PER_PROMPT


def loads_exact(client: KVStoreClient, seeds) -> bool:
    for seed in seeds:
        hashes, expected = prompt(seed)
        n, out = load(client, hashes)
        if n != BLOCKS_PER_PROMPT:
            return False
        assert all(np.array_equal(a, b) for a, b in zip(out, expected)), f"prompt {seed}: wrong bytes"
    return True


def quietly(check, *args) -> bool:
    """`check(*args)`, False where it raised (the store answers again, but not every call yet)."""
    try:
        return check(*args)
    except AssertionError:
        raise
    except Exception:  # noqa: BLE001 (a client call the store refused while it comes back)
        return False


def eventually(predicate, timeout_s: float, what: str, c: TwoReplicas) -> float:
    """wait_until, with the replicas' warnings on a time-out; returns the seconds it took."""
    t0 = time.monotonic()
    try:
        wait_until(predicate, timeout_s, what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; readyz {c.readyz()}, w0 {[c.state(u) for u in c.urls]}\n{c.log_tail()}") \
            from None
    return time.monotonic() - t0


def test_replicas_rejoin_and_workers_die_on_time_after_postgres_restarts(tmp_path, database):
    c = TwoReplicas(tmp_path, database.create_database())
    client = None
    try:
        c.start()
        assert DirectoryClient(c.urls[0]).stats().leader and not DirectoryClient(c.urls[1]).stats().leader
        client = KVStoreClient(",".join(c.urls), NS, staging_bytes=BLOCKS_PER_PROMPT * NS.block_nbytes)
        timings = []
        for restart, seeds in enumerate((range(0, 3), range(10, 13))):
            for seed in seeds:
                assert saved_whole(client, seed), seed
            assert loads_exact(client, seeds)
            epoch = c.epoch()

            database.stop_and_start(DOWN_S)
            back = time.monotonic()

            # saves resume; every replica serves again, the one that lost its lock with its connection included
            eventually(lambda: quietly(saved_whole, client, 100 + restart), RESUMED_S, "a save", c)
            eventually(c.settled, READY_S, "every replica ready, one leader", c)
            ready_s = time.monotonic() - back
            # what was saved before the restart loads exact, once the dust has settled too (the outage
            # was no silence of the worker's: its DRAM blocks stay)
            eventually(lambda: quietly(loads_exact, client, [*seeds, 100 + restart]), SHORT_S, "exact loads", c)
            assert c.epoch() == epoch  # the worker never had to register again

            # a worker that dies now is dead on every replica within its heartbeat timeout
            c.worker.send_signal(signal.SIGKILL)
            c.worker.wait()
            dead_s = eventually(lambda: all(c.state(url) == "dead" for url in c.urls), HEARTBEAT_S + DEAD_MARGIN_S,
                                "w0 dead on every replica", c)
            leader = [DirectoryClient(url).stats().leader for url in c.urls].index(True)
            timings.append({"leader": leader, "ready_s": round(ready_s, 1), "dead_s": round(dead_s, 1)})
            c.start_worker()  # for the next round (its DRAM starts empty: new prompts are saved)
            eventually(c.settled, READY_S, "every replica ready with the new worker", c)
        leaders = [DirectoryClient(url).stats().leader for url in c.urls]
        assert sorted(leaders) == [False, True], leaders
        print(f"\npostgres restarts: {timings}")
    finally:
        if client is not None:
            client.close()
        c.close()
