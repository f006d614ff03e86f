"""Retry-After: what the directory sends with 429/503 (and 401/405 headers), what the client makes
of it, and how long a hand-off wait pauses when the directory asks for patience."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvstore.client.http import JsonHttp, retry_after
from kvstore.connector import handoff
from kvstore.core.errors import KVStoreError
from kvstore.directory.http.hot import _relayed_headers


class _Server:
    """A loopback HTTP server answering every GET with (status, headers, body) from `answer`."""

    def __init__(self, status: int, headers: dict[str, str], body: dict) -> None:
        outer = self
        self.calls = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                outer.calls += 1
                payload = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {**headers, "content-length": str(len(payload))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = []
    yield lambda *a: made.append(_Server(*a)) or made[-1]
    for server in made:
        server.close()


def test_errors_carry_the_headers_their_status_needs():
    assert KVStoreError("throttled", "slow down", retry_after_s=2.2).headers() == {"retry-after": "3"}
    assert KVStoreError("throttled", "slow down").headers() == {"retry-after": "1"}
    assert KVStoreError("unavailable", "db away", retry_after_s=0.1).headers() == {"retry-after": "1"}
    assert KVStoreError("unavailable", "db away").headers() == {}  # no promise the server cannot keep
    assert KVStoreError("method_not_allowed", "no", allow=["GET", "HEAD"]).headers() == {"allow": "GET, HEAD"}
    assert KVStoreError("unauthorized", "who").headers() == {"www-authenticate": "Bearer"}
    # a follower relays the leader's answer with the same headers, rebuilt from its body
    body = json.dumps(KVStoreError("throttled", "slow", retry_after_s=4).to_body()).encode()
    assert _relayed_headers(429, body) == [(b"retry-after", b"4")]
    assert _relayed_headers(200, b"{}") == [] and _relayed_headers(502, b"not json") == []


def test_retry_after_is_read_in_seconds_and_nonsense_is_none():
    assert [retry_after(v) for v in ("3", "0.5", None, "Wed, 21 Oct 2015 07:28:00 GMT", "-1", "1e9")] == \
        [3.0, 0.5, None, None, None, None]


def test_a_429_says_when_to_ask_again_and_the_call_does_not_wait_for_it(servers):
    busy = servers(429, {"Retry-After": "7"}, {"error": "throttled", "detail": "slow down", "context": {}})
    client = JsonHttp(busy.url)
    started = time.monotonic()
    with pytest.raises(KVStoreError) as refused:
        client.call_raw("GET", "/v1/x")
    assert refused.value.kind == "throttled" and refused.value.context["retry_after_s"] == 7.0
    assert time.monotonic() - started < 5  # an engine's call is a miss now, not a wait
    client.close()


def test_a_server_that_answers_503_with_retry_after_is_skipped_that_long_with_jitter(servers):
    away = servers(503, {"Retry-After": "20"}, {"error": "unavailable", "detail": "db away", "context": {}})
    fine = servers(200, {}, {"ok": True})
    skips = []
    for _ in range(20):
        client = JsonHttp(f"{away.url},{fine.url}")
        assert client.call_raw("GET", "/v1/x") == {"ok": True}
        skips.append(client._servers[0].skip_until - time.monotonic())
        assert client.call_raw("GET", "/v1/x") == {"ok": True}  # the next call goes straight to `fine`
        client.close()
    assert away.calls == 20 and fine.calls == 40
    assert all(19 <= s <= 25.1 for s in skips), skips  # 20 s, plus up to a quarter
    assert max(skips) - min(skips) > 0.1  # not all at once


def test_a_handoff_wait_pauses_as_long_as_the_directory_asks(monkeypatch):
    pauses = []
    answers = [KVStoreError("throttled", "too many waits", retry_after_s=3.0),
               KVStoreError("unavailable", "cannot reach"), None]

    class Directory:
        def wait_handoff(self, wait):
            answer = answers.pop(0)
            if answer is not None:
                raise answer
            return type("State", (), {"state": "committed", "num_tokens": 32})()

    monkeypatch.setattr(handoff.time, "sleep", pauses.append)
    result = handoff.wait_for_handoff(Directory(), "0" * 16, "h", ["ab" * 8], time.monotonic() + 60)
    assert result.outcome == "committed" and result.num_tokens == 32
    assert 2.4 <= pauses[0] <= 3.6 and handoff.RETRY_S * 0.8 <= pauses[1] <= handoff.RETRY_S * 1.2


def test_the_leaders_hot_path_keeps_retry_after_on_its_own_refusals(stack, monkeypatch):
    """A hot call the leader itself refuses (here: its index is being built) carries Retry-After,
    as the same refusal relayed through a follower does."""
    monkeypatch.setattr(type(stack.service), "ready", property(lambda _service: False))
    answer = stack.http.post("/v1/lookup", json={"namespace_id": stack.namespace_id, "hashes": ["ab" * 16]})
    assert answer.status_code == 503 and answer.json()["error"] == "unavailable"
    assert answer.headers.get("retry-after") == "1"
