"""Credentials, scopes, tenants and worker identity, over HTTP against the directory in this process.

The route matrix is read from the app's own route table: a route added without an entry in
kvstore.directory.http.auth.ROUTES stops the app from starting, and every protected route is called
here without a token, with an unknown one, and with a token of each scope.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from types import SimpleNamespace

import httpx
import pytest

from kvstore.cli.serve import bootstrap_token
from kvstore.core import specs
from kvstore.core.credentials import SCOPES
from kvstore.core.errors import KVStoreError
from kvstore.directory.http.auth import PUBLIC, ROUTES, flat_routes
from tests.calls import chain, complete, hits, prepare
from tests.stacks import DEFAULT_MARKS, NS, PAGE, directory_stack, dram_tier, make_settings, registration

PARAMS = {"{name}": "w0", "{namespace_id}": "0" * 16, "{token_id}": "0" * 16}


def _routes(stack) -> list[tuple[str, str]]:
    return sorted((m, r.path) for r in flat_routes(stack.app.fastapi.routes) for m in r.methods if m != "HEAD")


def _call(stack, method: str, template: str, token: str | None = None) -> httpx.Response:
    path = template
    for name, value in PARAMS.items():
        path = path.replace(name, value)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    body = {} if method in ("POST", "PUT") else None
    return stack.http.request(method, path, headers=headers, json=body)


def test_the_scope_table_names_exactly_the_app_routes(secure):
    assert set(_routes(secure)) == set(ROUTES)


def test_every_protected_route_is_a_401_without_a_token_or_with_an_unknown_one(secure):
    protected = [(m, p) for m, p in _routes(secure) if ROUTES[(m, p)] != PUBLIC]
    assert len(protected) >= 25
    for method, path in protected:
        for token in (None, "kvs_not-a-token", "Basic abc"):
            answer = _call(secure, method, path, token)
            assert answer.status_code == 401, (method, path, token, answer.text)
            assert answer.json()["error"] == "unauthorized"
            assert answer.headers["www-authenticate"] == "Bearer"
    for method, path in [(m, p) for m, p in _routes(secure) if ROUTES[(m, p)] == PUBLIC]:
        assert _call(secure, method, path).status_code == 200, path


def test_each_scope_reaches_its_routes_and_gets_403_elsewhere(secure):
    tokens = {scope: secure.token(scope, tenants=("acme",) if scope == "engine" else ()) for scope in SCOPES}
    matrix = {}
    for method, path in _routes(secure):
        needed = ROUTES[(method, path)]
        if not needed:
            continue
        for scope, token in tokens.items():
            answer = _call(secure, method, path, token)
            allowed = scope == "admin" or scope in needed
            matrix[(method, path, scope)] = answer.status_code
            if allowed:
                assert answer.status_code not in (401, 403), (method, path, scope, answer.text)
            else:
                assert answer.status_code == 403, (method, path, scope, answer.text)
                assert answer.json()["error"] == "forbidden"
    assert sum(code == 403 for code in matrix.values()) >= 50


def test_a_path_the_guard_does_not_know_never_reaches_the_app(secure):
    """Starlette's route patterns end in `$`, which also matches before a trailing newline; a path
    no guard entry matches exactly is refused by the guard itself, never forwarded."""
    body = {"name": "sneaky", "scopes": ["admin"], "all": True}
    for method, path in (("POST", "/v1/admin/tokens%0A"), ("POST", "/v1/admin/evict%0a"), ("GET", "/v1/workers%0A"),
                         ("POST", "/v1/workers/w0/drain%0A"), ("GET", "/v1/tiers/"), ("POST", "/v1/nowhere")):
        answer = secure.http.request(method, path, json=body)
        assert answer.status_code == 404 and answer.json()["error"] == "not_found", (method, path, answer.text)
    # a path that exists, with a method it does not have: 405 and what it takes, before any credential
    for method, path, allow in (("DELETE", "/v1/admin/tokens", "GET, HEAD, POST"), ("PUT", "/v1/admin/evict", "POST"),
                                ("PATCH", "/v1/workers/w0/drain", "POST"), ("POST", "/healthz", "GET, HEAD")):
        for headers in ({}, {"Authorization": "Bearer kvs_nobody"}):
            answer = secure.http.request(method, path, json=body, headers=headers)
            assert (answer.status_code, answer.headers.get("allow")) == (405, allow), (method, path, answer.text)
            assert answer.json()["error"] == "method_not_allowed" and "Traceback" not in answer.text
    assert "sneaky" not in {t.name for t in secure.client.tokens()}
    assert secure.client.worker("w0").state == "active"


def test_metrics_open_only_when_the_operator_says_so(database_url):
    with directory_stack(make_settings(database_url, require_auth=True, open_metrics=True)) as s:
        assert s.http.get("/metrics").status_code == 200
        assert s.http.get("/v1/tiers").status_code == 401


def test_one_token_cannot_hold_every_hand_off_wait(secure, monkeypatch):
    import threading

    from kvstore.core.handoffs import HandoffWait
    from kvstore.directory import handoffs
    from tests.helpers import wait_until

    monkeypatch.setattr(handoffs, "MAX_WAITERS_PER_CALLER", 1)
    first, second = (secure.as_(secure.token("engine", tenants=("acme",))) for _ in range(2))
    ns_id = first.register_namespace(dataclasses.replace(NS, tenant="acme"))

    def wait(client, timeout_s: float):
        return client.wait_handoff(HandoffWait(namespace_id=ns_id, handoff_id="h", timeout_s=timeout_s))
    held = threading.Thread(target=lambda: wait(first, 2.5))
    held.start()
    wait_until(lambda: secure.service.handoffs.waiting() == 1, 10, "the first token's wait is open")
    with pytest.raises(KVStoreError) as refused:
        wait(first, 0.1)
    assert refused.value.kind == "throttled" and "this token" in refused.value.message
    assert wait(second, 0.1).state == "pending"  # another token of the same tenant still waits
    held.join(10)
    assert wait(first, 0.1).state == "pending" and secure.service.handoffs.waiting() == 0


def test_an_engine_sees_only_its_own_tenants_namespaces(secure):
    acme = secure.as_(secure.token("engine", tenants=("acme",)))
    globex = secure.as_(secure.token("engine", tenants=("globex",)))
    ns_acme, ns_globex = dataclasses.replace(NS, tenant="acme"), dataclasses.replace(NS, tenant="globex")
    acme_id, globex_id = acme.register_namespace(ns_acme), globex.register_namespace(ns_globex)
    with pytest.raises(KVStoreError) as refused:
        globex.register_namespace(ns_acme)
    assert refused.value.kind == "forbidden"

    hashes = chain(3)
    engine = SimpleNamespace(client=acme, namespace_id=acme_id)
    assert complete(engine, prepare(engine, hashes)).committed == 3
    assert hits(engine, hashes) == 3

    def answer(call):
        try:
            call()
        except KVStoreError as exc:
            return exc.kind, exc.message
        return "answered"

    for ns_id, other in ((acme_id, "f" * 16), (globex_id, "e" * 16)):
        client = globex if ns_id == acme_id else acme
        calls = [lambda c, n: c.lookup(n, hashes),
                 lambda c, n: c.lookup_tokens(n, list(range(8))),
                 lambda c, n: c.call_raw("POST", "/v1/lookup/batch", {"namespace_id": n, "prompts": [hashes]}),
                 lambda c, n: c.prepare_load(specs.PrepareLoad(namespace_id=n, hashes=hashes)),
                 lambda c, n: c.prepare_store(specs.PrepareStore(namespace_id=n, blocks=[
                     specs.BlockToStore(hash=hashes[0], nbytes=NS.block_nbytes)]))]
        for call in calls:  # another tenant's namespace answers as one that does not exist
            foreign, missing = answer(lambda: call(client, ns_id)), answer(lambda: call(client, other))
            assert foreign == missing and foreign[0] == "not_found", (foreign, missing)
    with pytest.raises(KVStoreError) as refused:  # evicting is for admins
        globex.evict_tier(specs.EvictRequest(tier="dram", namespace_id=acme_id))
    assert refused.value.kind == "forbidden"
    assert hits(engine, hashes) == 3  # nothing the other tenant did touched them
    listed = {n.namespace_id: n for n in acme.namespaces()}  # an engine lists its own tenants' only
    assert set(listed) == {acme_id} and listed[acme_id].blocks == {"dram": 3}
    assert listed[acme_id].bytes == {"dram": 3 * 2 * PAGE} and listed[acme_id].tenant == "acme"
    assert [n.namespace_id for n in globex.namespaces()] == [globex_id]
    everyone = {n.namespace_id for n in secure.as_(secure.token("read")).namespaces()}
    assert {acme_id, globex_id, secure.namespace_id} <= everyone


def _registration(name: str, secret: str | None = None, url: str = "") -> specs.WorkerRegistration:
    return registration(name, url, control_secret=secret, tiers=[dram_tier(4, **DEFAULT_MARKS)])


def test_a_forged_registration_cannot_take_a_live_workers_name(secure):
    owner, intruder = secure.as_(secure.token("worker")), secure.as_(secure.token("worker"))
    epoch = owner.register_worker(_registration("wx", "s" * 32, "http://127.0.0.1:9")).epoch
    for call in (lambda: intruder.register_worker(_registration("wx", "t" * 32)),
                 lambda: intruder.register_worker(_registration("wy", "t" * 32, "http://127.0.0.1:9")),
                 lambda: intruder.heartbeat("wx", epoch), lambda: intruder.deregister("wx", epoch)):
        with pytest.raises(KVStoreError) as refused:
            call()
        assert refused.value.kind in ("conflict", "forbidden")
    assert secure.client.worker("wx").epoch == epoch  # untouched
    with secure.service.sessions() as session:
        from kvstore.directory.db import repository as repo
        assert repo.worker_by_name(session, "wx").control_secret == "s" * 32
    owner.heartbeat("wx", epoch)
    owner.deregister("wx", epoch)  # gone: the name is free again
    assert intruder.register_worker(_registration("wx", "t" * 32)).epoch == epoch + 1


def test_a_revoked_token_is_refused_at_once(secure):
    token = secure.token("read")
    reader = secure.as_(token)
    assert reader.stats().indexed_blocks == secure.client.stats().indexed_blocks  # the token works until revoked
    token_id = next(t.id for t in secure.client.tokens() if t.name == "read" and t.revoked_at is None)
    secure.client.revoke_token(token_id)
    with pytest.raises(KVStoreError) as refused:
        reader.stats()
    assert refused.value.kind == "unauthorized"
    secure.app.state.tokens.load()  # what another directory reading the table would find
    assert secure.app.state.tokens.authenticate(token) is None
    revoked = [t for t in secure.client.tokens() if t.id == token_id]
    assert len(revoked) == 1 and revoked[0].revoked_at is not None


def test_the_last_live_admin_token_cannot_be_revoked(secure):
    def live_admins(client):
        return [t.id for t in client.tokens() if "admin" in t.scopes and t.revoked_at is None]
    [own] = live_admins(secure.client)  # the client's
    with pytest.raises(KVStoreError) as refused:
        secure.client.revoke_token(own)
    assert refused.value.kind == "conflict" and "last live admin token" in refused.value.message
    assert live_admins(secure.client) == [own]  # still in
    second = secure.as_(secure.token("admin"))
    [other] = [t for t in live_admins(second) if t != own]
    assert secure.client.revoke_token(own).revoked_at is not None  # another admin is left
    with pytest.raises(KVStoreError) as refused:
        second.revoke_token(other)  # itself, now the last one
    assert refused.value.kind == "conflict" and live_admins(second) == [other]
    assert second.revoke_token(own).revoked_at is not None  # a revoked one again: nothing changes


def test_token_creation_checks_its_input(secure):
    for body in ({"name": "x", "scopes": ["engine"]}, {"name": "x", "scopes": ["root"]},
                 {"name": "x", "scopes": ["read"], "tenants": ["acme"]}, {"name": "", "scopes": ["read"]}):
        answer = secure.http.post("/v1/admin/tokens", json=body,
                                  headers={"authorization": f"Bearer {secure.token('admin')}"})
        assert answer.status_code == 400, (body, answer.text)
    assert "kvs_" not in secure.http.get("/v1/admin/tokens", headers={
        "authorization": f"Bearer {secure.token('admin')}"}).text  # secrets are never listed


def test_an_engine_token_over_its_rate_gets_429_with_retry_after(database_url):
    with directory_stack(make_settings(database_url, require_auth=True, engine_rate=1, engine_burst=3)) as s:
        headers = {"authorization": f"Bearer {s.token('engine', tenants=('',))}"}
        body = {"namespace_id": s.namespace_id, "hashes": chain(1)}
        codes = [s.http.post("/v1/lookup", json=body, headers=headers) for _ in range(5)]
        assert [a.status_code for a in codes[:3]] == [200, 200, 200]
        assert codes[4].status_code == 429 and codes[4].json()["error"] == "throttled"
        assert int(codes[4].headers["retry-after"]) >= 1
        admin = {"authorization": f"Bearer {s.token('admin')}"}
        assert all(s.http.post("/v1/lookup", json=body, headers=admin).status_code == 200 for _ in range(5))


def test_evicting_everything_needs_all_true(secure):
    admin = {"authorization": f"Bearer {secure.token('admin')}"}
    answer = secure.http.post("/v1/admin/evict", json={}, headers=admin)
    assert answer.status_code == 400 and "all" in answer.json()["detail"]
    plan = secure.http.post("/v1/admin/evict", json={"all": True, "dry_run": True}, headers=admin)
    assert plan.status_code == 200


def test_verify_writes_commits_only_blocks_the_worker_confirms(database_url):
    with directory_stack(make_settings(database_url, verify_writes=True)) as s:
        s.verdicts.intact = False  # the bytes do not hash to what the writer claims
        hashes = chain(2)
        assert complete(s, prepare(s, hashes)).committed == 0
        assert hits(s, hashes) == 0 and len(s.verdicts.asked) == 2
        s.verdicts.intact = True
        assert complete(s, prepare(s, hashes)).committed == 2
        assert hits(s, hashes) == 2


def test_the_bootstrap_token_file_is_private_and_kept_while_valid(secure, tmp_path):
    path, elsewhere = tmp_path / "admin.token", tmp_path / "elsewhere"
    elsewhere.write_text("someone else's file\n")
    path.symlink_to(elsewhere)  # replaced, never followed
    tokens = secure.app.state.tokens
    assert bootstrap_token(tokens, path, "admin") == "written"
    assert not path.is_symlink() and elsewhere.read_text() == "someone else's file\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = path.read_text().strip()
    assert tokens.authenticate(first).scopes == {"admin"}
    assert bootstrap_token(tokens, path, "admin") == "kept"
    tokens.revoke(tokens.authenticate(first).id)
    assert bootstrap_token(tokens, path, "admin") == "written" and path.read_text().strip() != first


def test_a_token_the_operator_chose_is_adopted_from_a_read_only_file(secure, tmp_path):
    import secrets as random

    tokens, path = secure.app.state.tokens, tmp_path / "worker.token"
    chosen = "kvs_" + random.token_urlsafe(32)
    path.write_text(chosen + "\n")
    path.chmod(0o400)
    assert tokens.authenticate(chosen) is None
    assert bootstrap_token(tokens, path, "worker") == "adopted"
    assert tokens.authenticate(chosen).scopes == {"worker"} and path.read_text().strip() == chosen
    assert bootstrap_token(tokens, path, "worker") == "kept"
    tokens.revoke(tokens.authenticate(chosen).id)  # a revoked token is never adopted again
    path.chmod(0o600)
    assert bootstrap_token(tokens, path, "worker") == "written" and path.read_text().strip() != chosen
    assert tokens.authenticate(chosen) is None
    for refused, mode in (("kvs_short", 0o600), ("kvs_" + "A" * 43, 0o600),  # malformed; typed, not drawn
                          ("kvs_" + random.token_urlsafe(32), 0o620)):  # a file its group may change
        path.write_text(refused + "\n")
        path.chmod(mode)
        assert bootstrap_token(tokens, path, "admin") == "written" and tokens.authenticate(refused) is None
    path.unlink()
    path.mkdir()  # not a file: one clear error
    with pytest.raises(KVStoreError) as unreadable:
        bootstrap_token(tokens, path, "admin")
    assert unreadable.value.kind == "invalid" and "cannot read the token file" in unreadable.value.message

def test_an_engine_client_over_its_rate_gets_misses_and_skipped_saves_never_an_exception(database_url):
    """Throttled lookups, loads and saves of KVStoreClient (and its layer-wise loads) are misses or
    skipped saves, each counted, as docs/operations.md says: never a 429 raised into the engine."""
    import torch

    from kvstore.connector import KVStoreClient

    with directory_stack(make_settings(database_url, require_auth=True, engine_rate=0.001, engine_burst=1)) as s:
        token = s.token("engine", tenants=("",))
        with KVStoreClient(s.url, NS, token=token, staging_bytes=8 * NS.block_nbytes) as client:  # the one call
            tokens = list(range(4 * NS.block_tokens))
            kv = [(torch.randn(NS.num_kv_heads, len(tokens), NS.head_dim),) * 2 for _ in range(NS.num_layers)]
            assert client.lookup(tokens) == 0
            assert client.save(tokens, kv) == 0
            assert client.load(tokens)[1] == 0
            layers = client.start_load_layers(tokens)
            assert layers.wait_layer(0) is None and layers.finish() == 0
            assert client.skipped == {("lookup", "throttled"): 1, ("save", "throttled"): 1,
                                      ("load", "throttled"): 2}
