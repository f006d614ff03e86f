"""Directory replicas on one PostgreSQL database, in this process over real HTTP: a follower answers
lookups from an index that follows the leader's commits and forwards every other call, the
caller's credential with it; a leader whose term or lock another replica took writes nothing more
and follows again; on SQLite there is one directory, the leader, and no change log."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import create_engine, text

from kvstore.client import DirectoryClient
from kvstore.core import specs
from kvstore.core.credentials import TokenCreate
from kvstore.core.errors import KVStoreError
from tests.component.test_directory import raw_post
from tests.helpers import wait_until
from tests.stacks import NS, PAGE, Verdicts, directory_replica, registration, worker_endpoint


def save(client: DirectoryClient, namespace_id: str, hashes: list[str]) -> int:
    blocks = [specs.BlockToStore(hash=h, parent=p, nbytes=NS.block_nbytes)
              for h, p in zip(hashes, [None, *hashes[:-1]])]
    prepared = client.prepare_store(specs.PrepareStore(namespace_id=namespace_id, blocks=blocks))
    done = [specs.BlockWritten(hash=b.hash, ok=True, checksum="0" * 16) for b in prepared.blocks]
    return client.complete_store(specs.CompleteStore(token=prepared.token, blocks=done)).committed


@pytest.mark.postgres
def test_a_follower_serves_lookups_and_forwards_the_rest_with_the_callers_credential(postgres):
    database_url = postgres.create_database()
    with worker_endpoint(verifier=Verdicts()) as control:
        with directory_replica(database_url, require_auth=True) as (leader_app, leader_url):
            tokens = leader_app.state.tokens
            engine, worker, admin = (tokens.create(TokenCreate(name=s, scopes=[s], tenants=t)).token
                                     for s, t in (("engine", [NS.tenant]), ("worker", []), ("admin", [])))
            with directory_replica(database_url, require_auth=True) as (_, url):  # reads the tokens at its start
                as_engine = DirectoryClient(url, token=engine)
                assert not DirectoryClient(url, token=admin).stats().leader
                assert DirectoryClient(leader_url, token=admin).stats().leader
                for token in (None, "kvs_" + "x" * 43):  # the leader checks the credential it is sent
                    with pytest.raises(KVStoreError) as refused:
                        DirectoryClient(url, token=token).register_namespace(NS)
                    assert refused.value.kind == "unauthorized"
                with pytest.raises(KVStoreError) as refused:  # an engine may not register workers
                    DirectoryClient(url, token=engine).register_worker(registration(control_url=control.url))
                assert refused.value.kind == "forbidden"
                DirectoryClient(url, token=worker).register_worker(registration(control_url=control.url))
                namespace_id = as_engine.register_namespace(NS)
                hashes = [f"{i:032x}" for i in range(1, 5)]
                assert save(as_engine, namespace_id, hashes) == 4
                # the follower's index follows the leader's commit
                wait_until(lambda: as_engine.lookup(namespace_id, hashes).num_hit_blocks == 4, 5, "hits on follower")
                tier = DirectoryClient(url, token=admin).tiers()[0]  # forwarded: the leader's page credit
                assert tier.credit_free_bytes == (32 - 4 * NS.block_nbytes // PAGE) * PAGE
                bad = httpx.post(url + "/v1/store/prepare", headers={"authorization": f"Bearer {engine}"},
                                 json={"namespace_id": namespace_id, "blocks": [{"hash": "zz", "nbytes": 1}]})
                assert bad.status_code == 400 and bad.json()["error"] == "invalid"
                huge = httpx.post(url + "/v1/namespaces", headers={"authorization": f"Bearer {engine}"},
                                  content=b"{" + b" " * (40 << 20) + b"}")
                assert huge.status_code == 413  # bounded before it is sent on
                # a follower checks the credential before it reads a body to send on: a caller without
                # one, announcing a registration's 1 GiB, is refused at once, the body never sent
                assert raw_post(url, "/v1/workers", length=1 << 30).startswith(b"HTTP/1.1 401")
                newer = tokens.create(TokenCreate(name="newer", scopes=["admin"])).token  # after the follower read
                assert DirectoryClient(url, token=newer).tiers()  # it reads the tokens again, then forwards
                # an eviction through the follower: the blocks leave its index too
                DirectoryClient(url, token=admin).evict(namespace_id)
                wait_until(lambda: as_engine.lookup(namespace_id, hashes).num_hit_blocks == 0, 5, "misses on follower")


@pytest.mark.postgres
def test_a_leader_whose_term_was_taken_writes_nothing_more(postgres):
    database_url = postgres.create_database()
    with directory_replica(database_url) as (app, url):
        client = DirectoryClient(url)
        assert client.stats().leader
        engine = create_engine(database_url)
        with engine.begin() as conn:  # what a new leader does first
            conn.execute(text("UPDATE directory_leader SET term = term + 1"))
        with pytest.raises(KVStoreError) as refused:
            client.register_namespace(NS)
        assert refused.value.kind == "unavailable"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM namespaces")).scalar() == 0  # rolled back
        assert httpx.get(url + "/healthz").status_code == 200  # it serves on: it steps down, no restart needed
        # it follows again and, alone, takes the lead again under a term of its own
        wait_until(lambda: client.stats().leader and client.stats().term == 3, 10, "the lead taken again")
        assert client.register_namespace(NS)
        engine.dispose()


@pytest.mark.postgres
def test_a_leader_that_lost_its_lock_to_another_replica_follows_it(postgres):
    """The leader's lock connection is cut (as a database restart cuts it) and another replica
    takes the lock before the leader notices (its ticks are slow here): the old leader steps down
    and follows the new one, at once and by itself; it forwards to it and answers lookups from an
    index read from SQL again. Before, it stopped serving until something restarted it."""
    database_url = postgres.create_database()
    admin = create_engine(database_url)
    with worker_endpoint(verifier=Verdicts()) as control:
        with directory_replica(database_url, reaper_interval_s=3.0) as (_, old_url), \
                directory_replica(database_url) as (_, new_url):
            old, new = DirectoryClient(old_url), DirectoryClient(new_url)
            assert old.stats().leader
            old.register_worker(registration(control_url=control.url))
            namespace_id = old.register_namespace(NS)
            before = [f"{i:032x}" for i in range(1, 4)]
            assert save(old, namespace_id, before) == 3
            with admin.connect() as conn:  # the lock's connection dies; the other replica asks every 0.5 s
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"))
            wait_until(lambda: new.stats().leader, 5, "the other replica leads")

            def follows() -> bool:
                return not old.stats().leader and httpx.get(old_url + "/readyz?workers=0").status_code == 200
            wait_until(follows, 10, "the old leader follows")
            assert httpx.get(old_url + "/healthz").status_code == 200
            assert old.lookup(namespace_id, before).num_hit_blocks == 3  # its index, read again
            after = [f"{i:032x}" for i in range(11, 14)]
            assert save(old, namespace_id, after) == 3  # forwarded to the new leader
            wait_until(lambda: old.lookup(namespace_id, after).num_hit_blocks == 3, 5, "it follows the commits")
            tier = old.tiers()[0]  # forwarded: the new leader's page credit, 6 blocks taken
            assert tier.credit_free_bytes == (32 - 6 * NS.block_nbytes // PAGE) * PAGE
    admin.dispose()


def test_on_sqlite_the_one_directory_leads_and_logs_no_changes(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'd.db'}"
    with directory_replica(database_url) as (_, url):
        client = DirectoryClient(url)
        namespace_id = client.register_namespace(NS)
        assert client.stats().leader and namespace_id
    engine = create_engine(database_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM changes")).scalar() == 0
    engine.dispose()


@pytest.mark.postgres
def test_a_follower_hears_of_a_handoff_from_the_change_log_after_its_blocks(postgres):
    """A consumer waiting on a follower is woken by a commit made on the leader, and finds the
    hand-off's blocks in the follower's index by then (the change log is applied in order)."""
    import threading
    import time

    from kvstore.core.handoffs import HandoffCommit, HandoffWait

    database_url = postgres.create_database()
    with worker_endpoint(verifier=Verdicts()) as control:
        with directory_replica(database_url) as (_, leader_url), directory_replica(database_url) as (_, url):
            leader, follower = DirectoryClient(leader_url), DirectoryClient(url)
            leader.register_worker(registration(control_url=control.url))
            namespace_id = leader.register_namespace(NS)
            def known() -> bool:  # lookups are the follower's own: it has read the namespace
                try:
                    return follower.lookup(namespace_id, hashes).num_hit_blocks == 0
                except KVStoreError:
                    return False
            hashes = [f"{i:032x}" for i in range(1, 4)]
            wait_until(known, 5, "the namespace known on the follower")
            seen = {}

            def consume() -> None:
                state = follower.wait_handoff(HandoffWait(namespace_id=namespace_id, handoff_id="pd-1",
                                                          timeout_s=8))
                seen["state"], seen["hits"] = state, follower.lookup(namespace_id, hashes).num_hit_blocks
            consumer = threading.Thread(target=consume)
            consumer.start()
            time.sleep(0.3)
            save(leader, namespace_id, hashes)
            leader.commit_handoff(HandoffCommit(namespace_id=namespace_id, handoff_id="pd-1", num_tokens=12))
            consumer.join(10)
            assert seen["state"].state == "committed" and seen["state"].waited_s < 3.0
            assert seen["hits"] == 3  # the blocks were in the follower's index when it heard


@pytest.mark.postgres
def test_a_follower_cut_off_from_the_database_says_so_and_follows_again_when_it_is_back(postgres):
    """A follower that cannot read the change log (its table locked) says so on /readyz (503) after
    10 s; then every connection of both replicas is cut and the database refuses new ones for a
    while: once it is back the follower follows again by itself (blocks the leader saved after the
    cut are hits there, /readyz is 200). Before, its background thread ended at the first error."""
    import time

    database_url = postgres.create_database()
    name = database_url.rsplit("/", 1)[1]
    admin = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{postgres.port}/postgres",
                          isolation_level="AUTOCOMMIT")

    def cut(allow: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {str(allow).lower()}"))
            if not allow:
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                             {"d": name})

    def saved(client, hashes) -> bool:
        try:
            return save(client, namespace_id, hashes) == len(hashes)
        except KVStoreError:
            return False  # the leader's own connections are being re-made

    with worker_endpoint(verifier=Verdicts()) as control:
        with directory_replica(database_url) as (_, leader_url), directory_replica(database_url) as (_, url):
            leader, follower = DirectoryClient(leader_url), DirectoryClient(url)
            leader.register_worker(registration(control_url=control.url))
            namespace_id = leader.register_namespace(NS)
            before, after = [f"{i:032x}" for i in range(1, 4)], [f"{i:032x}" for i in range(11, 14)]
            wait_until(lambda: saved(leader, before), 10, "a first save")
            wait_until(lambda: follower.lookup(namespace_id, before).num_hit_blocks == 3, 5, "hits on the follower")
            locker = create_engine(database_url)  # the change log cannot be read for a while
            with locker.connect() as lock:
                lock.execute(text("LOCK TABLE changes IN ACCESS EXCLUSIVE MODE"))
                time.sleep(12)  # past the follower's lag bound
                ready = httpx.get(url + "/readyz?workers=0")
                assert ready.status_code == 503 and "has not read the leader's changes" in ready.text, ready.text
                lock.rollback()
            locker.dispose()
            wait_until(lambda: httpx.get(url + "/readyz?workers=0").status_code == 200, 15, "ready again")
            try:
                cut(allow=False)  # every connection of both replicas, and no new one for a while
                with pytest.raises(KVStoreError) as outage:  # a database outage is a 503, never a 500
                    save(leader, namespace_id, [f"{i:032x}" for i in range(21, 23)])
                assert outage.value.kind == "unavailable", outage.value
                time.sleep(3)
                assert httpx.get(url + "/readyz?workers=0").status_code == 503
            finally:
                cut(allow=True)
            wait_until(lambda: saved(leader, after), 30, "a save once the database is back")
            wait_until(lambda: follower.lookup(namespace_id, after).num_hit_blocks == 3, 30,
                       "the follower follows again")
            wait_until(lambda: httpx.get(url + "/readyz?workers=0").status_code == 200, 30, "the follower ready")
            assert follower.stats().follower_lag_s < 5
    admin.dispose()


@pytest.mark.postgres
def test_rate_limits_are_per_replica_and_writes_spend_the_leaders(postgres):
    """Each replica keeps its own bucket per engine token: lookups a follower answers spend its
    bucket, and every write is forwarded and spends the leader's (so N replicas allow up to N
    times the lookup rate, and the write rate once). A refusal relayed by a follower keeps the
    leader's Retry-After."""
    database_url = postgres.create_database()
    limits = {"require_auth": True, "engine_rate": 0.01, "engine_burst": 3}  # 3 calls, then one per 100 s
    with directory_replica(database_url, **limits) as (leader_app, leader_url):
        tokens = leader_app.state.tokens
        admin = tokens.create(TokenCreate(name="a", scopes=["admin"])).token
        engine = tokens.create(TokenCreate(name="e", scopes=["engine"], tenants=[NS.tenant])).token
        namespace_id = DirectoryClient(leader_url, token=admin).register_namespace(NS)
        with directory_replica(database_url, **limits) as (_, follower_url):
            hashes = {"namespace_id": namespace_id, "hashes": ["0" * 32]}
            auth = {"authorization": f"Bearer {engine}"}
            on_leader = [httpx.post(leader_url + "/v1/lookup", json=hashes, headers=auth) for _ in range(4)]
            on_follower = [httpx.post(follower_url + "/v1/lookup", json=hashes, headers=auth) for _ in range(4)]
            for answers in (on_leader, on_follower):  # each replica: its own burst of 3, then 429
                assert [a.status_code for a in answers] == [200, 200, 200, 429], [a.text for a in answers]
                assert int(answers[-1].headers["retry-after"]) >= 90
            forwarded = httpx.post(follower_url + "/v1/namespaces", json={"namespace": NS.to_dict()}, headers=auth)
            assert forwarded.status_code == 429 and forwarded.json()["error"] == "throttled"  # the leader's bucket
            assert int(forwarded.headers["retry-after"]) >= 90  # relayed with the leader's answer
