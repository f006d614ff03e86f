"""What operators read from the directory: /readyz, request and worker metrics, prefix inspection,
and token lookups in a namespace whose keys vLLM made."""

from __future__ import annotations

import re

import pytest
import xxhash
from sqlalchemy.engine import make_url

from kvstore.core import specs, vllm_hashes
from kvstore.core.errors import KVStoreError
from kvstore.core.inspection import InspectRequest
from kvstore.core.keys import Namespace
from tests.calls import chain, complete, prepare
from tests.helpers import Proxy, wait_until
from tests.stacks import NS, PAGE, directory_stack, make_settings


def metric(text: str, name: str, **labels) -> float | None:
    """The value of the series `name{labels}` in a Prometheus text page; None if absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', series))
        if series.split("{")[0] == name and found == {k: str(v) for k, v in labels.items()}:
            return float(value)
    return None


def test_readyz_needs_the_database_and_a_live_worker(stack):
    ready = stack.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["live_workers"] == 1
    stack.client.deregister("w0", 1)
    wait_until(lambda: stack.http.get("/readyz").status_code == 503, 5, "unready")  # read again within 1 s
    gone = stack.http.get("/readyz")
    assert gone.json()["context"] == {"live_workers": 0}
    assert "0 live workers" in gone.json()["detail"]
    assert stack.http.get("/readyz?workers=0").status_code == 200  # what a probe before any worker asks
    for bad in ("-1", "x", "10000000"):
        answer = stack.http.get(f"/readyz?workers={bad}")
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", bad


def test_requests_are_timed_by_route_template_and_status(stack):
    complete(stack, prepare(stack, chain(2)))
    for _ in range(3):
        stack.client.lookup(stack.namespace_id, chain(2))
    stack.http.get("/v1/workers/w0")
    stack.http.get("/v1/nowhere")
    stack.http.post("/v1/lookup", json={"namespace_id": "0" * 16, "hashes": []})
    text = stack.http.get("/metrics").text
    assert metric(text, "kvstore_request_seconds_count", route="/v1/lookup", method="POST", status=200) == 3
    assert metric(text, "kvstore_request_seconds_count", route="/v1/lookup", method="POST", status=404) == 1
    assert metric(text, "kvstore_request_seconds_count", route="/v1/store/prepare", method="POST", status=200) == 1
    assert metric(text, "kvstore_request_seconds_count", route="/v1/workers/{name}", method="GET", status=200) == 1
    assert metric(text, "kvstore_request_seconds_count", route="unmatched", method="", status=404) == 1
    assert metric(text, "kvstore_request_seconds_bucket", route="/v1/lookup", method="POST", status=200,
                  le="+Inf") == 3


def test_series_of_a_worker_that_is_gone_are_removed(stack):
    text = stack.http.get("/metrics").text
    assert 0 <= metric(text, "kvstore_heartbeat_age_seconds", worker="w0") < 60
    assert metric(text, "kvstore_tier_capacity_bytes", worker="w0", kind="dram") == 32 * PAGE
    assert metric(text, "kvstore_tier_high_watermark_ratio", worker="w0", kind="dram") == 1.0
    assert metric(text, "kvstore_workers", state="active") == 1
    stack.client.deregister("w0", 1)
    text = stack.http.get("/metrics").text
    assert "w0" not in text  # heartbeat age, tier usage, capacity, watermarks: all gone
    assert metric(text, "kvstore_workers", state="dead") == 1 and metric(text, "kvstore_workers", state="active") == 0


def test_inspect_shows_each_block_its_replicas_and_their_pins(stack):
    hashes = chain(3)
    complete(stack, prepare(stack, hashes[:2]))
    req = InspectRequest(namespace_id=stack.namespace_id, hashes=hashes)
    blocks = stack.client.inspect(req).blocks
    assert [(b.position, b.hash, b.stored) for b in blocks] == [(0, hashes[0], True), (1, hashes[1], True),
                                                                (2, hashes[2], False)]
    assert [(r.worker, r.tier, r.state, r.pins) for r in blocks[0].replicas] == [("w0", "dram", "ready", 0)]
    assert blocks[0].nbytes == NS.block_nbytes and blocks[2].replicas == []
    load = stack.client.prepare_load(specs.PrepareLoad(namespace_id=stack.namespace_id, hashes=hashes[:1]))
    assert [r.pins for r in stack.client.inspect(req).blocks[0].replicas] == [1]
    stack.client.complete_load(specs.CompleteLoad(token=load.token, blocks=[]))
    by_tokens = stack.client.inspect(InspectRequest(namespace_id=stack.namespace_id, token_ids=list(range(13))))
    assert [b.hash for b in by_tokens.blocks] == hashes  # 13 tokens: 3 full blocks of 4
    assert by_tokens.block_tokens == NS.block_tokens


def test_inspect_refuses_bad_input_and_every_caller_but_an_admin(secure):
    for body in ({"namespace_id": secure.namespace_id},  # neither token ids nor hashes
                 {"namespace_id": secure.namespace_id, "token_ids": [1], "hashes": ["ab" * 16]},
                 {"namespace_id": secure.namespace_id, "hashes": ["not hex"]},
                 {"namespace_id": secure.namespace_id, "hashes": ["ab" * 16] * 4097},
                 {"namespace_id": secure.namespace_id, "token_ids": [2**31]}):
        with pytest.raises(KVStoreError) as refused:
            secure.client.call_raw("POST", "/v1/admin/inspect", body)
        assert refused.value.kind == "invalid", body
    ok = {"namespace_id": secure.namespace_id, "hashes": ["ab" * 16] * 4096}
    with pytest.raises(KVStoreError) as refused:
        secure.as_(None).call_raw("POST", "/v1/admin/inspect", ok)
    assert refused.value.kind == "unauthorized"
    # what a tenant's prompts hold and when they were read: not for its engines, nor for monitoring
    for scopes, tenants in ((("engine",), ("",)), (("read",), ())):
        with pytest.raises(KVStoreError) as refused:
            secure.as_(secure.token(*scopes, tenants=tenants)).call_raw("POST", "/v1/admin/inspect", ok)
        assert refused.value.kind == "forbidden", scopes
    answer = secure.as_(secure.token("admin")).call_raw("POST", "/v1/admin/inspect", ok)
    assert len(answer["blocks"]) == 4096 and not answer["blocks"][0]["stored"]


def _vllm_namespace(seed: str) -> Namespace:
    none_hash = vllm_hashes._hash("sha256", seed)
    return Namespace(**{**NS.to_dict(), "layout": "layer_head_token_kvdim",
                        "hash_scheme": f"vllm-sha256-none:{xxhash.xxh64_hexdigest(none_hash)}"})


def _save(stack, ns_id: str, hashes: list[str]) -> None:
    prepared = stack.client.prepare_store(specs.PrepareStore(namespace_id=ns_id, blocks=[
        specs.BlockToStore(hash=h, parent=p, nbytes=NS.block_nbytes) for h, p in zip(hashes, [None] + hashes)]))
    complete(stack, prepared)


def test_token_lookups_hash_like_vllm_with_the_engines_seed(stack):
    tokens = list(range(100, 111))  # 2 full blocks of 4
    for seed in (None, "42"):
        ns = _vllm_namespace(seed or vllm_hashes.DEFAULT_SEED)
        ns_id = stack.client.register_namespace(ns)
        _save(stack, ns_id, vllm_hashes.block_hashes(ns.hash_scheme, 4, tokens, seed))
        assert stack.client.lookup_tokens(ns_id, tokens, hash_seed=seed).hit_tokens == 8
        with pytest.raises(KVStoreError) as refused:
            stack.client.lookup_tokens(ns_id, tokens, hash_seed="7")
        assert refused.value.kind == "invalid" and "--hash-seed" in refused.value.message
    assert stack.client.lookup_tokens(stack.namespace_id, tokens).hit_tokens == 0  # the store's own scheme
    other = Namespace(**{**NS.to_dict(), "hash_scheme": "sglang-radix-v1"})
    with pytest.raises(KVStoreError) as refused:
        stack.client.lookup_tokens(stack.client.register_namespace(other), tokens)
    assert refused.value.kind == "invalid" and "give the hashes" in refused.value.message


@pytest.mark.postgres
def test_readyz_says_when_the_database_does_not_answer(postgres):
    url = make_url(postgres.create_database())
    proxy = Proxy(url.port)  # the directory reaches PostgreSQL through a connection the test can cut
    settings = make_settings(url.set(port=proxy.port).render_as_string(hide_password=False))
    try:
        with directory_stack(settings) as stack:
            assert stack.http.get("/readyz").status_code == 200
            proxy.cut()
            wait_until(lambda: stack.http.get("/readyz").status_code == 503, 5, "unready")  # within 1 s
            assert "database does not answer" in stack.http.get("/readyz").json()["detail"]
            proxy.restore()
            wait_until(lambda: stack.http.get("/readyz").status_code == 200, 30, "ready again")
    finally:
        proxy.cut()
