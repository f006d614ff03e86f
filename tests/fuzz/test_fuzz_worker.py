"""Hypothesis against the worker's control endpoint over real sockets: valid requests with one
field replaced by any JSON value, arbitrary bytes as bodies, arbitrary content-lengths and paths,
with and without the worker's secret. Every request gets an HTTP answer below 500 with an error
body unless it succeeded, and the endpoint keeps serving."""

from __future__ import annotations

import copy
import json
import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore.core.pages import PageAllocator
from kvstore.worker.control import ControlServer
from tests.helpers import raw_request

SECRET = "s" * 43
RUN = {"first": 0, "count": 1}
VALID = {
    "/v1/grant": {"token": "g", "kind": "dram", "max_pages": 2},
    "/v1/alloc": {"token": "t", "kind": "dram", "sizes": [128, 256]},
    "/v1/free": {"items": [{"token": "t", "runs": [RUN]}, {"token": "x", "runs": [], "object": "k"}]},
    "/v1/move": {"items": [{"src_kind": "dram", "src_runs": [RUN], "dst_kind": "nvme", "dst_runs": [RUN],
                            "dst_token": "d", "nbytes": 128, "checksum": "0" * 16, "namespace_id": "0" * 16,
                            "hash": "ab"}], "expires_at": 4e9},
    "/v1/verify": {"items": [{"kind": "dram", "runs": [RUN], "nbytes": 128, "checksum": "0" * 16}]},
    "/v1/fence": {"tokens": ["move-1-ab", "t"]},
}
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
                    | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
RANDOM = bool(os.environ.get("KVSTORE_FUZZ_RANDOM"))  # explore new inputs instead of the fixed ones
EXAMPLES = 300


@pytest.fixture(scope="module")
def control():
    deleted = []
    server = ControlServer({"dram": PageAllocator(16, 128), "nvme": PageAllocator(16, 128)}, secret=SECRET,
                           object_tiers={"s3": lambda name, token: deleted.append(name)})
    server.start()
    yield server
    try:
        assert raw_request(server, "GET /healthz HTTP/1.1\r\nhost: x\r\n") == (200, {"status": "ok"}), \
            "the endpoint stopped serving during the fuzz"
    finally:
        server.stop()


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _paths(inner, (*prefix, i))


@st.composite
def mutated(draw):
    route = draw(st.sampled_from(sorted(VALID)))
    body = copy.deepcopy(VALID[route])
    path = draw(st.sampled_from([p for p in _paths(body) if p]))
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()):
        parent[path[-1]] = draw(JSON)
    elif isinstance(parent, dict):
        del parent[path[-1]]
    return route, json.dumps(body).encode()


def _send(control, route: str, body: bytes, secret: str | None = SECRET, length: str | None = None):
    auth = f"authorization: Bearer {secret}\r\n" if secret else ""
    head = f"POST {route} HTTP/1.1\r\nhost: x\r\n{auth}content-length: {len(body) if length is None else length}\r\n"
    return raw_request(control, head, body)


def _answered(status: int, answer: dict) -> None:
    assert status < 500, answer
    assert status == 200 or answer["error"] in ("invalid", "not_found", "unauthorized", "too_large", "conflict",
                                                 "no_space"), answer


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(case=mutated())
def test_valid_requests_with_one_field_changed(control, case):
    _answered(*_send(control, *case))


@FUZZ
@given(route=st.sampled_from([*VALID, "/", "/v1/", "/v1/alloc/x"]) | st.text(min_size=1, max_size=20).map(
    lambda t: "/" + t.encode("ascii", "ignore").decode().replace(" ", "").replace("\r", "").replace("\n", "")),
       body=st.binary(max_size=300), secret=st.sampled_from([SECRET, None, "wrong"]))
def test_arbitrary_bytes_paths_and_credentials(control, route, body, secret):
    status, answer = _send(control, route, body, secret)
    _answered(status, answer)
    if secret != SECRET and route in VALID:
        assert status == 401


@FUZZ
@given(length=st.text(alphabet="0123456789-+ xe", max_size=12))
def test_arbitrary_content_lengths(control, length):
    body = b'{"token":"t","kind":"dram","sizes":[1]}'
    # a length beyond the body is a client that is still sending: the idle timeout ends it
    assume(not length.strip().isdigit() or int(length) <= len(body))
    status, answer = _send(control, "/v1/alloc", body, length=length)
    _answered(status, answer)


def test_the_endpoint_still_serves_after_bad_requests(control):
    """On its own too (the fixture checks again after the whole module): a burst of garbage on every
    route, then a health check."""
    rng = random.Random(7)
    for route in [*VALID, "/", "/v1/nope"]:
        for secret in (SECRET, None, "wrong"):
            _answered(*_send(control, route, rng.randbytes(rng.randrange(1, 200)), secret))
    status, answer = raw_request(control, "GET /healthz HTTP/1.1\r\nhost: x\r\n")
    assert (status, answer) == (200, {"status": "ok"})
