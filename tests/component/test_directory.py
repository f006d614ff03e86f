"""The directory's protocol, story by story, over HTTP (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace, block_hashes
from kvstore.core import pace
from tests.calls import BLOCK, chain, complete, hits, prepare
from tests.stacks import DEFAULT_MARKS, NS, PAGE, dram_tier, registration


def test_a_block_is_visible_only_after_complete(stack):
    hashes = chain(3)
    prepared = prepare(stack, hashes)
    assert [b.status for b in prepared.blocks] == ["admitted"] * 3
    assert hits(stack, hashes) == 0  # WRITING is invisible
    assert stack.client.stats().reservations == 3
    assert complete(stack, prepared).committed == 3
    assert hits(stack, hashes) == 3
    assert hits(stack, hashes[:2] + chain(1, start=999)) == 2  # longest prefix only
    assert stack.client.stats().reservations == 0


def test_a_chain_saved_over_several_calls_continues_its_depth(stack):
    """Chunked prefill saves a prompt's blocks step by step; each call names the stored parent."""
    from sqlalchemy import select

    from kvstore.directory.db.engine import make_engine, make_sessions
    from kvstore.directory.db.models.block import Block

    hashes = chain(4)
    complete(stack, prepare(stack, hashes[:2]))
    complete(stack, prepare(stack, hashes[2:], parent=hashes[1]))
    engine = make_engine(stack.settings.database_url)
    with make_sessions(engine)() as session:
        depths = dict(session.execute(select(Block.hash, Block.depth)).all())
    engine.dispose()
    assert [depths[h] for h in hashes] == [0, 1, 2, 3]


def test_several_prefixes_are_leased_under_one_token_and_shared_blocks_pinned_once(stack):
    one = [h.hex() for h in block_hashes(NS, list(range(16)))]  # 4 blocks
    two = [h.hex() for h in block_hashes(NS, list(range(8)) + list(range(500, 508)))]  # its first 2 are one's
    complete(stack, prepare(stack, one))
    complete(stack, prepare(stack, two[2:], parent=two[1]))
    batch = stack.client.prepare_loads(specs.PrepareLoads(namespace_id=stack.namespace_id, reader="engine",
                                                          chains=[one, two, chain(1, start=900)]))
    assert [[b.hash for b in hits] for hits in batch.chains] == [one, two, []]
    assert (stack.client.stats().leases_active, stack.client.stats().pins) == (1, 6)  # 4 + 2 replicas
    released = stack.client.complete_load(specs.CompleteLoad(token=batch.token, blocks=[
        specs.BlockRead(hash=h, ok=True) for h in sorted(set(one + two))]))
    assert released.released == 6 and stack.client.stats().pins == 0
    empty = stack.client.prepare_loads(specs.PrepareLoads(namespace_id=stack.namespace_id, chains=[chain(1, start=900)]))
    assert (empty.token, empty.chains) == (None, [[]])


def test_locations_cover_the_block_in_worker_addresses(stack):
    prepared = prepare(stack, chain(1))
    location = prepared.blocks[0].location
    assert location.worker == "w0" and location.tier == "dram"
    assert sum(length for _, length in location.runs) == BLOCK
    assert all(addr >= 1 << 20 for addr, _ in location.runs)


def test_an_aborted_store_is_never_visible_and_gives_its_pages_back(stack):
    hashes = chain(2)
    prepared = prepare(stack, hashes)
    assert stack.free_pages() == 32 - 4
    stack.http.post("/v1/store/abort", json={"token": prepared.token}).raise_for_status()
    assert hits(stack, hashes) == 0
    assert stack.free_pages() == 32
    assert stack.client.stats().blocks == 0
    with pytest.raises(KVStoreError) as info:  # completing after abort is refused
        complete(stack, prepared)
    assert info.value.kind == "conflict"


def test_a_failed_write_rolls_back_only_that_block(stack):
    hashes = chain(2)
    prepared = prepare(stack, hashes)
    reports = [specs.BlockWritten(hash=hashes[0], ok=True, checksum="00000000000000aa"),
               specs.BlockWritten(hash=hashes[1], ok=False)]
    done = stack.client.complete_store(specs.CompleteStore(token=prepared.token, blocks=reports))
    assert (done.committed, done.rolled_back) == (1, 1)
    assert hits(stack, hashes) == 1


def test_existing_and_in_progress_blocks_are_not_written_twice(stack):
    first = prepare(stack, chain(2))
    second = prepare(stack, chain(3))
    assert [b.status for b in second.blocks] == ["in_progress", "in_progress", "admitted"]
    complete(stack, first)
    third = prepare(stack, chain(3))
    assert [b.status for b in third.blocks] == ["exists", "exists", "in_progress"]


def test_duplicate_completion_is_a_conflict_and_changes_nothing(stack):
    prepared = prepare(stack, chain(2))
    complete(stack, prepared)
    with pytest.raises(KVStoreError) as info:
        complete(stack, prepared)
    assert info.value.kind == "conflict"
    assert hits(stack, chain(2)) == 2


def test_no_space_rejects_the_block_and_every_suffix_after_it(stack):
    # 32 pages, 2 per block: 16 fit, the 17th and later are rejected
    prepared = prepare(stack, chain(18))
    statuses = [b.status for b in prepared.blocks]
    assert statuses[:16] == ["admitted"] * 16
    assert [(b.status, b.reason) for b in prepared.blocks[16:]] == [("rejected", "no_space")] * 2
    complete(stack, prepared)
    assert hits(stack, chain(18)) == 16


def test_a_load_pins_under_a_lease_until_complete(stack):
    hashes = chain(3)
    complete(stack, prepare(stack, hashes))
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    assert len(load.blocks) == 3 and load.blocks[0].checksum == "0123456789abcdef"
    stats = stack.client.stats()
    assert (stats.leases_active, stats.pins) == (1, 3)
    done = stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=[]))
    assert done.released == 3
    stats = stack.client.stats()
    assert (stats.leases_active, stats.pins) == (0, 0)
    for reports in ([], [specs.BlockRead(hash=hashes[0], ok=False)]):  # a released token is gone
        with pytest.raises(KVStoreError) as info:
            stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=reports))
        assert info.value.kind == "conflict"
    assert hits(stack, hashes) == 3


def test_a_checksum_failure_invalidates_the_replica(stack):
    hashes = chain(3)
    complete(stack, prepare(stack, hashes))
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    reports = [specs.BlockRead(hash=hashes[1], ok=False)]
    assert stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=reports)).invalidated == 1
    assert hits(stack, hashes) == 1
    assert stack.free_pages() == 32 - 4  # the bad replica's pages went back
    assert "kvstore_checksum_failures_total 1.0" in stack.http.get("/metrics").text


def test_a_load_has_at_most_its_share_of_reported_blocks_checked_and_keeps_the_others(stack, monkeypatch):
    from kvstore.directory.loads import loads

    monkeypatch.setattr(loads, "VERIFIED_PER_CALL", 2)
    hashes = chain(3)
    complete(stack, prepare(stack, hashes))
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    reports = [specs.BlockRead(hash=h, ok=False) for h in reversed(hashes)]
    assert stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=reports)).invalidated == 2
    assert len(stack.verdicts.asked) == 2 and stack.free_pages() == 32 - 2  # the first reported two went
    assert hits(stack, hashes[:1]) == 1  # the third reported, the chain's first, is kept


def test_a_reported_mismatch_the_worker_does_not_confirm_changes_nothing(stack):
    hashes = chain(3)
    complete(stack, prepare(stack, hashes))
    stack.verdicts.intact = True  # the bytes are fine: the reader is wrong (or lying)
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes))
    reports = [specs.BlockRead(hash=h, ok=False) for h in hashes]
    done = stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=reports))
    assert (done.released, done.invalidated) == (3, 0)
    assert hits(stack, hashes) == 3 and stack.client.stats().pins == 0
    asked = stack.verdicts.asked
    assert [(i.kind, i.nbytes, i.checksum) for i in asked] == [("dram", BLOCK, "0123456789abcdef")] * 3
    assert sorted(i.runs[0].count for i in asked) == [2, 2, 2]  # the pages each replica holds


def test_lookup_under_another_namespace_finds_nothing(stack):
    complete(stack, prepare(stack, chain(2)))
    for other in (Namespace(**{**NS.to_dict(), "model_id": "other"}),
                  Namespace(**{**NS.to_dict(), "num_kv_heads": 2})):
        other_id = stack.client.register_namespace(other)
        tokens = list(range(8))
        assert stack.client.lookup(other_id, [h.hex() for h in block_hashes(other, tokens)]).num_hit_blocks == 0
        assert stack.client.lookup_tokens(other_id, tokens).hit_tokens == 0
    assert stack.client.lookup_tokens(stack.namespace_id, list(range(11))).hit_tokens == 8


def test_lookups_answered_make_tier_sized_work_on_other_threads_rest(stack, monkeypatch):
    rests = []
    monkeypatch.setattr(pace, "_last_served", float("-inf"))
    monkeypatch.setattr(pace, "WORK_S", 0.0)
    monkeypatch.setattr(pace, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=rests.append))
    with pace.tier_sized():
        list(pace.paced(range(32), every=16))
        assert rests == []  # nobody calls yet
        stack.client.lookup(stack.namespace_id, ["ab" * 16])
        assert pace.calls_coming()
        list(pace.paced(range(32), every=16))  # this thread is not the server's event loop
        assert rests == [pace.REST_S] * 2


def test_a_namespace_body_says_what_it_lacks_and_the_document_says_what_it_needs(stack):
    answer = stack.http.post("/v1/namespaces", json={"namespace": {}})
    assert answer.status_code == 400 and answer.json()["error"] == "invalid"
    assert "needs model_id, num_layers" in answer.json()["detail"] and "__init__" not in answer.text
    answer = stack.http.post("/v1/namespaces", json={"namespace": {**NS.to_dict(), "num_layers": 2.5}})
    assert answer.status_code == 400 and "num_layers must be an integer" in answer.json()["detail"]
    doc = stack.http.get("/openapi.json").json()
    body = doc["components"]["schemas"]["NamespaceBody"]["properties"]["namespace"]
    assert body["required"] == ["model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens"]
    assert body["properties"]["num_layers"] == {"type": "integer", "minimum": 1, "maximum": 65536}
    assert "bfloat16" in body["properties"]["dtype"]["enum"] and body["additionalProperties"] is False


def test_the_document_states_the_rules_the_server_enforces(stack):
    doc = stack.http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    # one of token_ids or hashes; evict names a tier, a namespace or all; tenants go with engine tokens
    assert [set(c["required"]) for c in schemas["InspectRequest"]["oneOf"]] == [{"token_ids"}, {"hashes"}]
    assert stack.http.post("/v1/admin/inspect", json={"namespace_id": "0" * 16}).status_code == 400
    assert [c["required"] for c in schemas["EvictRequest"]["anyOf"]] == [["tier"], ["namespace_id"], ["all"]]
    assert stack.http.post("/v1/admin/evict", json={}).status_code == 400
    assert schemas["TokenCreate"]["then"]["properties"]["tenants"]["minItems"] == 1
    assert schemas["TokenCreate"]["else"]["properties"]["tenants"]["maxItems"] == 0
    assert schemas["PrepareLoads"]["properties"]["namespace_id"]["maxLength"] == 16
    assert "pattern" in schemas["WorkerRegistration"]["properties"]["agent_metadata"]
    # JSON Schema's integers include 5.0: the server takes them as the document says
    namespace_id = stack.client.register_namespace(NS)
    floats = {k: float(v) if isinstance(v, int) else v for k, v in NS.to_dict().items()}
    answer = stack.http.post("/v1/namespaces", json={"namespace": floats})
    assert answer.status_code == 200 and answer.json()["namespace_id"] == namespace_id
    body = {"namespace_id": namespace_id, "blocks": [{"hash": "ab" * 8, "nbytes": float(NS.block_nbytes)}]}
    answer = stack.http.post("/v1/store/prepare", json=body)
    assert answer.status_code == 200 and answer.json()["blocks"][0]["status"] == "admitted", answer.text
    body["blocks"][0]["nbytes"] = NS.block_nbytes + 0.5
    assert stack.http.post("/v1/store/prepare", json=body).status_code == 400


def test_a_registration_the_document_refuses_is_refused(stack):
    good = json.loads(registration("wz").model_dump_json())
    survivor = {"kind": "nvme", "token": "t", "runs": [{"first": False, "count": 1}], "namespace_id": "0" * 16,
                "hash": "0" * 32, "nbytes": 1, "checksum": "0" * 16}
    hbm = {**good["tiers"][0], "kind": "hbm", "device": -1}
    for bad in ({"agent_metadata": ""}, {"inventory": [survivor]}, {"control_url": "ftp://host"},
                {"tiers": [hbm]}, {"tiers": [{**hbm, "device": 1 << 16}]}, {"control_url": "http://\x9e\x80:1"}):
        answer = stack.http.post("/v1/workers", json={**good, **bad})
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", (bad, answer.text)
    assert "wz" not in {w.name for w in stack.client.workers()}


def test_unknown_namespace_and_bad_bodies_get_error_bodies(stack):
    answer = stack.http.post("/v1/lookup", json={"namespace_id": "0" * 16, "hashes": []})
    assert answer.status_code == 404 and answer.json()["error"] == "not_found"
    answer = stack.http.post("/v1/lookup", json={"namespace_id": stack.namespace_id, "hashes": ["XYZ"]})
    assert answer.status_code == 400 and answer.json()["error"] == "invalid"
    for path, body in [("/v1/lookup", {"hashes": ["00", "0g0", "ab"]}), ("/v1/load/prepare", {"hashes": ["a-b"]}),
                       ("/v1/load/prepare-batch", {"chains": [["00"], ["00", "0 1"]]}),
                       ("/v1/lookup", {"hashes": ["0"]}), ("/v1/lookup", {"hashes": ["0" * 129]}),
                       ("/v1/store/prepare", {"blocks": [{"hash": "ab", "nbytes": BLOCK, "parent": "a_"}]}),
                       ("/v1/store/prepare", {"blocks": [{"hash": "aB", "nbytes": BLOCK}]})]:
        answer = stack.http.post(path, json={"namespace_id": stack.namespace_id, **body})
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", (path, body)
    for path, blocks in [("/v1/store/complete", [{"hash": "ab", "ok": True, "checksum": "0123456789abcdeg"}]),
                         ("/v1/store/complete", [{"hash": "ab", "ok": True, "checksum": "0123"}]),
                         ("/v1/store/complete", [{"hash": "xy", "ok": True}]),
                         ("/v1/load/complete", [{"hash": "ab", "ok": True}, {"hash": "é0", "ok": False}])]:
        answer = stack.http.post(path, json={"token": "t" * 32, "blocks": blocks})
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", (path, blocks)
    answer = stack.http.post("/v1/store/complete", json={"token": "t" * 32, "blocks": [
        {"hash": "ab", "ok": True, "checksum": "0123456789ABCDEF"}]})
    assert answer.status_code == 409  # upper-case checksum digits are fine; the token is unknown
    answer = stack.http.post("/v1/namespaces", json={"namespace": {"model_id": "m"}})
    assert answer.status_code == 400 and "namespace" in answer.json()["detail"]
    answer = stack.http.post("/v1/store/prepare", json={"namespace_id": stack.namespace_id, "blocks": [
        {"hash": chain(1)[0], "nbytes": 7}]})
    assert answer.status_code == 400 and answer.json()["context"]["expected"] == BLOCK


def test_work_and_bodies_are_bounded(stack):
    def post(path: str, body: dict, status: int = 400, error: str = "invalid") -> dict:
        answer = stack.http.post(path, json=body)
        assert answer.status_code == status and answer.json()["error"] == error, (path, answer.text[:300])
        return answer.json()

    one_token = {**NS.to_dict(), "block_tokens": 1}
    ns_id = stack.http.post("/v1/namespaces", json={"namespace": one_token}).json()["namespace_id"]
    detail = post("/v1/lookup/tokens", {"namespace_id": ns_id, "token_ids": list(range(100_001))})["detail"]
    assert "100000 blocks" in detail  # within the token-id cap, over the blocks it would hash
    post("/v1/lookup/tokens", {"namespace_id": ns_id, "token_ids": [0] * ((1 << 20) + 1)})
    assert stack.client.lookup_tokens(ns_id, list(range(100_000))).num_hit_blocks == 0
    post("/v1/lookup/batch", {"namespace_id": stack.namespace_id, "prompts": [["ab"]] * 4097})
    post("/v1/lookup/batch", {"namespace_id": stack.namespace_id, "prompts": [["ab"] * 60_000] * 2})
    for bad in ({"num_layers": 65536, "num_kv_heads": 65536}, {"model_id": "m" * 257}, {"tenant": "t" * 257}):
        post("/v1/namespaces", {"namespace": {**NS.to_dict(), **bad}})
    post("/v1/store/prepare", {"namespace_id": stack.namespace_id, "blocks": [{"hash": "ab", "nbytes": 1 << 31}]})
    long_id = "a" * 100_000  # never echoed back whole
    assert len(stack.http.post("/v1/lookup/batch", json={"namespace_id": long_id, "prompts": [["ab"]]}).content) \
        < 2_000
    for path, body in (("/v1/lookup/batch", {"namespace_id": long_id, "prompts": [["ab"]]}),
                       ("/v1/lookup/tokens", {"namespace_id": long_id, "token_ids": [1]}),
                       ("/v1/leases/renew", {"token": long_id}), ("/v1/store/abort", {"token": long_id}),
                       ("/v1/load/complete", {"token": long_id})):
        post(path, body)
    for path, body in (("/v1/load/prepare", {"hashes": ["ab"], "reader": "r" * 201}),
                       ("/v1/load/prepare-batch", {"chains": [["ab"]], "reader": "r" * 201}),
                       ("/v1/store/prepare", {"blocks": [{"hash": "ab", "nbytes": BLOCK}], "writer": "w" * 201})):
        post(path, {"namespace_id": stack.namespace_id, **body})
    for path in ("/v1/lookup", "/v1/lookup/batch", "/v1/namespaces"):
        assert raw_post(stack.url, path, length=(32 << 20) + 1).startswith(b"HTTP/1.1 413")  # refused unread
        answer = raw_post(stack.url, path, chunks=33)  # no length: counted as it comes
        assert answer.startswith(b"HTTP/1.1 413") and b'"too_large"' in answer, (path, answer[:200])
        assert raw_post(stack.url, path, chunks=1).split(b" ")[1] in (b"400", b"422"), path  # under: parsed
    assert hits(stack, chain(1)) == 0  # still serving


def raw_post(url: str, path: str, length: int | None = None, chunks: int = 0) -> bytes:
    """A POST over a bare socket: headers announcing `length` bytes (none sent), or `chunks` chunks of
    1 MiB with chunked transfer encoding; returns what the server answered."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        head += f"content-length: {length}\r\n\r\n" if length is not None else "transfer-encoding: chunked\r\n\r\n"
        try:
            sock.sendall(head.encode())
            for _ in range(chunks):
                sock.sendall(b"100000\r\n" + b" " * (1 << 20) + b"\r\n")
            if chunks:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the rest arrived
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_a_survivor_whose_pages_cannot_hold_it_is_not_adopted(stack):
    good, short = chain(2)

    def survivor(block_hash: str, pages: int) -> specs.Survivor:
        return specs.Survivor(kind="nvme", token="t", runs=[specs.PageRun(first=4 * pages, count=pages)],
                              namespace_id=stack.namespace_id, hash=block_hash, nbytes=BLOCK,
                              checksum="0123456789abcdef")
    stack.client.register_worker(registration(
        "w1", pid=2, backends=["UCX", "POSIX"],
        tiers=[dram_tier(32, base_addr=1 << 30, **DEFAULT_MARKS),
               specs.TierSpec(kind="nvme", capacity_bytes=32 * PAGE, page_bytes=PAGE)],
        inventory=[survivor(good, 2), survivor(short, 1)]))
    assert hits(stack, [good]) == 1 and hits(stack, [short]) == 0
    assert stack.client.lookup(stack.namespace_id, [good], locations=True).blocks[0].location.tier == "nvme"


def test_batch_lookup(stack):
    complete(stack, prepare(stack, chain(2)))
    answer = stack.http.post("/v1/lookup/batch", json={"namespace_id": stack.namespace_id,
                                                       "prompts": [chain(3), chain(1), chain(2, start=50)]})
    assert [r["num_hit_blocks"] for r in answer.json()["results"]] == [2, 1, 0]


def test_a_worker_with_a_new_epoch_loses_its_dram_replicas(stack):
    complete(stack, prepare(stack, chain(2)))
    with pytest.raises(KVStoreError) as info:
        stack.client.heartbeat("w0", epoch=99)
    assert info.value.kind == "conflict"
    again = stack.register_worker(control_url=stack.client.worker("w0").control_url)
    assert again.epoch == 2
    assert hits(stack, chain(2)) == 0
    assert stack.client.stats().blocks == 0
    assert stack.client.tiers()[0].used_bytes == 0


def test_health_metrics_and_tiers(stack):
    assert stack.http.get("/healthz").json() == {"status": "ok"}
    assert stack.http.get("/readyz").json()["status"] == "ready"
    complete(stack, prepare(stack, chain(2)))
    tier = stack.client.tiers()[0]
    assert (tier.kind, tier.capacity_bytes, tier.used_bytes, tier.num_blocks) == ("dram", 32 * PAGE, 4 * PAGE, 2)
    text = stack.http.get("/metrics").text
    assert f'kvstore_tier_used_bytes{{kind="dram",worker="w0"}} {4.0 * PAGE}' in text
    assert "kvstore_blocks 2.0" in text
    assert 'kvstore_tier_replicas{tier="dram"} 2.0' in text and "kvstore_inflight_moves 0.0" in text
    stats = stack.client.stats()
    assert (stats.blocks, stats.replicas_by_tier, stats.inflight_moves, stats.reservations) == (2, {"dram": 2}, 0, 0)
    assert stack.http.get("/openapi.json").json()["info"]["title"] == "kvstore directory"


def test_the_openapi_document_describes_every_hot_call(stack):
    doc = stack.http.get("/openapi.json").json()
    for path, body, answer in [("/v1/lookup", "LookupRequest", "LookupResult"),
                               ("/v1/store/prepare", "PrepareStore", "StorePrepared"),
                               ("/v1/store/complete", "CompleteStore", "StoreCompleted"),
                               ("/v1/load/prepare", "PrepareLoad", "LoadPrepared"),
                               ("/v1/load/prepare-batch", "PrepareLoads", "LoadsPrepared"),
                               ("/v1/load/complete", "CompleteLoad", "LoadCompleted")]:
        operation = doc["paths"][path]["post"]
        assert "parameters" not in operation, path  # everything is in the body
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok.endswith("/" + answer) and body in doc["components"]["schemas"], path
    # the credential, declared so that generated clients send it; health needs none
    assert doc["components"]["securitySchemes"]["bearer"] == {**doc["components"]["securitySchemes"]["bearer"],
                                                              "type": "http", "scheme": "bearer"}
    assert doc["paths"]["/v1/lookup"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/v1/lookup"]["post"]["x-kvstore-scopes"] == ["engine"]
    assert doc["paths"]["/v1/admin/evict"]["post"]["x-kvstore-scopes"] == ["admin"]
    assert "security" not in doc["paths"]["/healthz"]["get"] and "security" not in doc["paths"]["/readyz"]["get"]


def test_a_worker_that_deregisters_takes_its_dram_replicas_along(stack):
    complete(stack, prepare(stack, chain(2)))
    with pytest.raises(KVStoreError) as info:
        stack.client.deregister("w0", epoch=7)
    assert info.value.kind == "conflict" and hits(stack, chain(2)) == 2
    stack.client.deregister("w0", epoch=1)
    assert hits(stack, chain(2)) == 0
    assert stack.client.workers()[0].state == "dead"


def test_admin_evict_drops_a_namespace_and_frees_its_pages_after_the_last_pin(stack):
    complete(stack, prepare(stack, chain(2)))
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=chain(1)))
    assert stack.client.evict(stack.namespace_id) == 2
    assert hits(stack, chain(2)) == 0
    assert stack.free_pages() == 32 - 2  # block 0 is still pinned by the reader
    stack.client.complete_load(specs.CompleteLoad(token=load.token))
    assert stack.free_pages() == 32
    assert stack.client.stats().blocks == 0


def test_evicting_everything_must_be_said_and_a_dry_run_changes_nothing(stack):
    complete(stack, prepare(stack, chain(2)))
    answer = stack.http.post("/v1/admin/evict", json={})
    assert answer.status_code == 400 and answer.json()["error"] == "invalid"
    assert hits(stack, chain(2)) == 2
    for body in ({"all": True, "dry_run": True}, {"namespace_id": stack.namespace_id, "dry_run": True}):
        dry = stack.http.post("/v1/admin/evict", json=body)
        assert dry.status_code == 200 and dry.json()["replicas"] == 2, dry.text
    assert hits(stack, chain(2)) == 2 and stack.free_pages() == 32 - 4
    assert stack.http.post("/v1/admin/evict", json={"all": True}).json()["replicas"] == 2
    assert hits(stack, chain(2)) == 0 and stack.free_pages() == 32


def test_a_full_bottom_tier_drops_least_recently_used_blocks_deepest_first(stack):
    old, recent = chain(8), chain(8, start=1000)  # 16 blocks fill the 32 pages
    complete(stack, prepare(stack, old))
    complete(stack, prepare(stack, recent))
    hits(stack, recent)  # touched: now the most recently used
    newcomer = chain(2, start=5000)
    assert [b.status for b in prepare(stack, newcomer).blocks] == ["admitted"] * 2  # room was made
    assert hits(stack, old) == 6  # the two deepest blocks of the cold chain went
    assert hits(stack, recent) == 8


def test_a_full_tier_makes_room_for_the_whole_pages_of_blocks_smaller_than_a_page(stack):
    """Blocks of 96 bytes take a 128-byte page each: room for a new save is counted in pages, not in
    KV bytes (which would free 6 pages for 8 blocks and reject 2 of them)."""
    small = Namespace(model_id="small", num_layers=1, num_kv_heads=1, head_dim=3, dtype="float32", block_tokens=4)
    namespace_id = stack.client.register_namespace(small)

    def save(start: int, n: int) -> list[str]:
        hashes = [h.hex() for h in block_hashes(small, list(range(start, start + 4 * n)))]
        prepared = stack.client.prepare_store(specs.PrepareStore(namespace_id=namespace_id, blocks=[
            specs.BlockToStore(hash=h, parent=p, nbytes=small.block_nbytes) for h, p in zip(hashes, [None] + hashes)]))
        complete(stack, prepared)
        return [b.status for b in prepared.blocks]

    assert small.block_nbytes == 96 and save(0, 32) == ["admitted"] * 32 and stack.free_pages() == 0
    assert save(1000, 8) == ["admitted"] * 8  # 8 pages made free, not 768 bytes' worth


def test_operator_eviction_by_bytes_with_a_dry_run(stack):
    complete(stack, prepare(stack, chain(4)))
    ask = dict(tier="dram", bytes=2 * BLOCK)
    dry = stack.client.evict_tier(specs.EvictRequest(**ask, dry_run=True))
    assert (dry.replicas, dry.bytes, dry.dropped, dry.demoted) == (2, 2 * BLOCK, 2, 0)  # says what it would do
    assert hits(stack, chain(4)) == 4  # a dry run changes nothing
    done = stack.client.evict_tier(specs.EvictRequest(**ask))
    assert (done.replicas, done.dropped, done.demoted) == (2, 2, 0)  # no tier below: dropped
    assert hits(stack, chain(4)) == 2
    with pytest.raises(KVStoreError) as info:
        stack.client.evict_tier(specs.EvictRequest(tier="dram", worker="nobody", bytes=1))
    assert info.value.kind == "not_found"


def test_namespace_policy_is_stored_and_unknown_namespaces_are_404(stack):
    answer = stack.http.put(f"/v1/namespaces/{stack.namespace_id}/policy", json={"write_through": True})
    assert answer.status_code == 200 and answer.json() == {"write_through": True, "replicas": 1}
    answer = stack.http.put(f"/v1/namespaces/{stack.namespace_id}/policy", json={"replicas": 2})
    assert answer.json() == {"write_through": True, "replicas": 2}  # what the body does not name stays
    assert stack.client.set_policy(stack.namespace_id, specs.NamespacePolicy(write_through=False)).replicas == 2
    assert [n.replicas for n in stack.client.namespaces()] == [2]
    for bad in (0, 4, "two"):
        answer = stack.http.put(f"/v1/namespaces/{stack.namespace_id}/policy", json={"replicas": bad})
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", bad
    answer = stack.http.put("/v1/namespaces/0000000000000000/policy", json={"write_through": True})
    assert answer.status_code == 404 and answer.json()["error"] == "not_found"
    answer = stack.http.put(f"/v1/namespaces/{stack.namespace_id}/policy", json={"write_through": "maybe"})
    assert answer.status_code == 400
