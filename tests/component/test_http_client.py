"""The JSON client's keep-alive connections: reuse, a connection the server closed while idle, errors."""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
import time

import pytest

from kvstore.client.http import JsonHttp
from kvstore.core.errors import KVStoreError


class ScriptedServer(socketserver.ThreadingTCPServer):
    """Answers each request by `script(n)` (n counts requests): "ok", "error" (409), "unready"
    (503), "worker-failed" (502), "close-after" (answer, then close the connection without saying
    so), "drop" (close without answering) or a list of raw pieces to write (None: close, "reset":
    close with a RST)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, script) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.requests, self.connections, self.header_lines = script, [], 0, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.server.connections += 1
        while True:
            line = self.rfile.readline()
            if not line:
                return
            headers = {}
            while (header := self.rfile.readline().strip()):
                self.server.header_lines.append(header.decode())
                name, _, value = header.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", 0)))
            self.server.requests.append((line.decode().split()[1], headers, body))
            action = self.server.script(len(self.server.requests))
            if action == "drop":
                return
            if isinstance(action, list):  # raw bytes, written piece by piece; None: close the connection
                for piece in action:
                    if piece is None:
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if piece == "reset":  # closed with a RST
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.connection.close()
                        return
                    self.wfile.write(piece)
                    self.wfile.flush()
                    time.sleep(0.01)  # each piece arrives on its own
                continue
            status, payload = {
                "error": (409, {"error": "conflict", "detail": "already there", "context": {"hash": "ab"}}),
                "unready": (503, {"error": "unavailable", "detail": "building the index", "context": {}}),
                "worker-failed": (502, {"error": "transfer_failed", "detail": "a worker failed", "context": {}}),
            }.get(action, (200, {"echo": json.loads(body or b"null")}))
            data = json.dumps(payload).encode()
            self.wfile.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: "
                             f"{len(data)}\r\n\r\n".encode() + data)
            if action == "close-after":
                self.connection.shutdown(socket.SHUT_RDWR)
                return


@pytest.fixture
def serve():
    servers = []

    def start(script):
        servers.append(ScriptedServer(script))
        return servers[-1]
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_calls_reuse_one_connection_and_send_the_token(serve):
    server = serve(lambda n: "ok")
    client = JsonHttp(server.url, token="secret")
    for i in range(5):
        assert client.call_raw("POST", "/v1/x", {"i": i}) == {"echo": {"i": i}}
    assert server.connections == 1
    assert all(h["authorization"] == "Bearer secret" for _, h, _ in server.requests)
    client.close()


def test_a_connection_the_server_closed_while_idle_is_replaced(serve):
    server = serve(lambda n: "close-after")
    client = JsonHttp(server.url)
    assert [client.call_raw("POST", "/v1/x", {"i": i})["echo"]["i"] for i in range(3)] == [0, 1, 2]
    assert server.connections == 3 and len(server.requests) == 3  # each request sent once


def test_a_reused_connection_dropped_mid_request_is_retried_once(serve):
    server = serve(lambda n: "drop" if n == 2 else "ok")
    client = JsonHttp(server.url)
    client.call_raw("POST", "/v1/x", {"i": 0})
    assert client.call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}}
    assert len(server.requests) == 3 and server.connections == 2


def test_a_new_connection_dropped_is_unavailable_without_a_retry(serve):
    server = serve(lambda n: "drop")
    with pytest.raises(KVStoreError) as info:
        JsonHttp(server.url, timeout_s=5).call_raw("POST", "/v1/x", {"i": 0})
    assert info.value.kind == "unavailable" and len(server.requests) == 1


def test_error_bodies_become_kvstore_errors(serve):
    server = serve(lambda n: "error")
    with pytest.raises(KVStoreError) as info:
        JsonHttp(server.url).call_raw("POST", "/v1/x", {"i": 0})
    assert info.value.kind == "conflict" and info.value.context == {"hash": "ab"}


def test_unreachable_and_malformed_urls():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(KVStoreError) as info:
            JsonHttp(f"http://127.0.0.1:{port}", timeout_s=2).call_raw("GET", "/healthz")
    assert info.value.kind == "unavailable"
    with pytest.raises(KVStoreError) as info:
        JsonHttp("127.0.0.1:8000")
    assert info.value.kind == "invalid"


def refused_url() -> tuple[socket.socket, str]:
    """A URL whose connections are refused (bound, not listening) while the socket is kept."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, f"http://127.0.0.1:{s.getsockname()[1]}"


def test_several_servers_a_dead_one_is_skipped_and_backed_off(serve, monkeypatch):
    import kvstore.client.http as http_module

    alive = serve(lambda n: "ok")
    held, dead = refused_url()
    client = JsonHttp(f"{dead}, {alive.url}", timeout_s=5)
    assert client.base_url == dead
    assert [s.url for s in JsonHttp([dead, alive.url])._servers] == [s.url for s in client._servers]  # a list too
    assert client.call_raw("POST", "/v1/x", {"i": 0}) == {"echo": {"i": 0}}
    assert client.base_url == alive.url  # the next calls go there first
    attempts = []
    real = client._exchange
    monkeypatch.setattr(client, "_exchange", lambda server, *a: attempts.append(server.url) or real(server, *a))
    for i in range(3):
        client.call_raw("POST", "/v1/x", {"i": i})
    assert attempts == [alive.url] * 3  # the dead one is not tried while it backs off
    held.close()
    now = time.monotonic()
    monkeypatch.setattr(http_module.time, "monotonic", lambda: now + 2 * http_module.MAX_BACKOFF_S)
    client.call_raw("POST", "/v1/x", {"i": 9})
    assert attempts[-1] == alive.url  # back-off over: the server that answered last is still first


def test_several_servers_503_and_500_move_on_but_other_errors_do_not(serve):
    unready, ok = serve(lambda n: "unready"), serve(lambda n: "ok")
    assert JsonHttp(f"{unready.url},{ok.url}").call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}}
    assert len(unready.requests) == 1
    for action, kind in (("worker-failed", "transfer_failed"), ("error", "conflict")):
        first, second = serve(lambda n, a=action: a), serve(lambda n: "ok")
        with pytest.raises(KVStoreError) as info:
            JsonHttp(f"{first.url},{second.url}").call_raw("POST", "/v1/x", {"i": 1})
        assert info.value.kind == kind and second.requests == []  # the answer stands: no second try


def test_several_servers_all_failing_raise_the_last_failure(serve):
    unready = serve(lambda n: "unready")
    held, dead = refused_url()
    with held, pytest.raises(KVStoreError) as info:
        JsonHttp(f"{unready.url},{dead}", timeout_s=5).call_raw("GET", "/v1/y")
    assert info.value.kind == "unavailable" and dead in info.value.message
    only = serve(lambda n: "unready")  # one server: its 503 is the caller's answer, as always
    with pytest.raises(KVStoreError) as info:
        JsonHttp(only.url).call_raw("GET", "/v1/y")
    assert info.value.message == "building the index"


def answer(body: bytes, *head: str, status: str = "200 OK", version: str = "HTTP/1.1") -> bytes:
    return "\r\n".join([f"{version} {status}", "content-type: application/json", *head]).encode() + \
        b"\r\n\r\n" + body


def test_answers_in_every_framing_http_allows_are_read_whole(serve):
    """Content-Length split across packets (the head cut mid-line), chunks with an extension and a
    trailer, a 100 Continue before the answer, a body read to the close, `Connection: close` and
    HTTP/1.0 (each followed by a new connection), 204 without a body."""
    body = b'{"a": [1, 2, 3], "b": "' + b"x" * 70_000 + b'"}'
    chunked = answer(b"5;ext=1\r\n" + body[:5] + b"\r\n" + f"{len(body) - 5:x}".encode() + b"\r\n" + body[5:] +
                     b"\r\n0\r\ntrailer: t\r\n\r\n", "transfer-encoding: chunked")
    whole = answer(body, f"content-length: {len(body)}")
    script = {
        1: [whole[:20], whole[20:45], whole[45:30_000], whole[30_000:]],
        2: [chunked[:100], chunked[100:]],
        3: [b"HTTP/1.1 100 Continue\r\n\r\n", whole],
        4: [answer(b'{"c": 1}', "connection: close", "content-length: 8")],
        5: [answer(b'{"d": 2}', "content-length: 8", version="HTTP/1.0")],
        6: [answer(b'{"e": 3}'), None],  # no length: the body ends with the connection
        7: [b"HTTP/1.1 204 No Content\r\n\r\n"],
        8: "ok",
    }
    server = serve(lambda n: script[n])
    client = JsonHttp(server.url, timeout_s=5)
    expected = json.loads(body)
    assert client.call_raw("POST", "/v1/x", {"i": 1}) == expected
    assert client.call_raw("POST", "/v1/x", {"i": 2}) == expected
    assert client.call_raw("POST", "/v1/x", {"i": 3}) == expected
    assert server.connections == 1  # kept alive through all three
    assert client.call_raw("POST", "/v1/x", {"i": 4}) == {"c": 1}
    assert client.call_raw("POST", "/v1/x", {"i": 5}) == {"d": 2}
    assert client.call_raw("POST", "/v1/x", {"i": 6}) == {"e": 3}
    assert client._request("POST", "/v1/x", {"i": 7}) == b""
    assert client.call_raw("POST", "/v1/x", {"i": 8}) == {"echo": {"i": 8}}
    assert server.connections == 4 and len(server.requests) == 8  # closed after 4, 5 and 6; nothing sent twice
    assert [h["host"] for _, h, _ in server.requests] == [server.url.split("//")[1]] * 8
    client.close()


def test_answers_that_are_not_http_or_are_cut_short_are_unavailable_and_never_reused(serve):
    script = {
        1: [b"SSH-2.0-OpenSSH\r\n\r\n"],
        2: [b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * (70 << 10) + b"\r\n\r\n"],
        3: [answer(b'{"short"', "content-length: 100"), None],
        4: [b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"],
        5: [answer(b"zz\r\n", "transfer-encoding: chunked"), None],
        9: [answer(b"{}", "content-length: +2"), None],
        10: [answer(b"{}", "content-length: 2", "content-length: 3"), None],
        11: [b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n"],
        6: [answer(b"-5\r\nabc", "transfer-encoding: chunked"), None],
        7: [answer(b"{}", f"content-length: {(1 << 30) + 1}"), None],
    }
    server = serve(lambda n: script.get(n, "ok"))
    client = JsonHttp(server.url, timeout_s=5)
    for i in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11):
        if i == 9:
            assert client.call_raw("POST", "/v1/x", {"i": 8}) == {"echo": {"i": 8}}
        with pytest.raises(KVStoreError) as info:
            client.call_raw("POST", "/v1/x", {"i": i})
        assert info.value.kind == "unavailable", i
    assert server.connections == 10 and len(server.requests) == 11  # a new connection after each failure, no retry
    server.header_lines.clear()
    status, _ = client.exchange("POST", "/v1/x", b"{}", {"Host": "elsewhere", "Content-Length": "99"})
    assert status == 200 and server.requests[-1][1]["host"] == server.url.split("//")[1]  # the framing is ours
    assert sorted(line.split(":")[0].lower() for line in server.header_lines) == ["content-length", "host"]


def test_request_lines_and_headers_cannot_be_split_by_the_caller(serve):
    """Refused as the caller's error before a byte is sent, through every entry point: a call's
    path, a forwarded exchange's target, method and headers, a token, a URL's path."""
    server = serve(lambda n: "ok")
    client = JsonHttp(server.url)
    refusals = [lambda path=path: client.call_raw("GET", path) for path in ("/v1/x y", "/v1/x\r\nx-injected: 1",
                                                                            "/v1/\x00")]
    refusals += [lambda: client.exchange("GET", "/v1/x y", None, {}),
                 lambda: client.exchange("GET /v1/x HTTP/1.1\r\n", "/v1/x", None, {}),
                 lambda: client.exchange("GET", "/v1/x", None, {"x-a": "1\r\nx-injected: 1"}),
                 lambda: client.exchange("GET", "/v1/x", None, {"x a": "1"}),
                 lambda: client.exchange("GET", "/v1/x", None, {"x-a": "caf\u00e9\u20ac"}),
                 lambda: JsonHttp(server.url, token="abc\r\nx-injected: 1"),
                 lambda: JsonHttp(server.url, token="t\u20ac"),
                 lambda: JsonHttp(server.url + "/a b")]
    for refused in refusals:
        with pytest.raises(KVStoreError) as info:
            refused()
        assert info.value.kind == "invalid"
    assert server.requests == [] and client._servers[0].skip_until == 0.0  # nothing sent, no server blamed
    assert client.call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}}


def test_a_reused_connection_is_asked_again_only_when_no_byte_of_an_answer_came(serve):
    """Dropped before answering: asked again on a new connection (it may never have read the
    request). Dropped after part of an answer: served already, so not sent twice: unavailable."""
    server = serve(lambda n: [b"HTTP/1.1 200 OK\r\ncontent-le", None] if n == 2 else "ok")
    client = JsonHttp(server.url, timeout_s=5)
    client.call_raw("POST", "/v1/x", {"i": 0})
    with pytest.raises(KVStoreError) as info:
        client.call_raw("POST", "/v1/x", {"i": 1})
    assert info.value.kind == "unavailable" and len(server.requests) == 2
    continued = serve(lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", None] if n == 2 else "ok")
    client = JsonHttp(continued.url, timeout_s=5)
    client.call_raw("POST", "/v1/x", {"i": 0})
    with pytest.raises(KVStoreError):
        client.call_raw("POST", "/v1/x", {"i": 1})
    assert len(continued.requests) == 2  # a 100 is a byte of the answer too
    for before, sent in (([], 3), ([b"HTTP/1.1 200 OK\r\ncontent-le"], 2)):  # reset at once / after a part
        reset = serve(lambda n, before=before: before + ["reset"] if n == 2 else "ok")
        client = JsonHttp(reset.url, timeout_s=5)
        client.call_raw("POST", "/v1/x", {"i": 0})
        try:
            assert client.call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}} and sent == 3
        except KVStoreError as exc:
            assert exc.kind == "unavailable" and sent == 2
        assert len(reset.requests) == sent


def test_bytes_past_an_answer_keep_its_connection_from_being_reused(serve, monkeypatch):
    import kvstore.client.connection as connection

    extra = answer(b'{"a": 1}', "content-length: 8") + b"HTTP/1.1 200 OK\r\n"  # the start of an answer to nothing
    server = serve(lambda n: [extra] if n == 1 else "ok")
    client = JsonHttp(server.url, timeout_s=5)
    assert client.call_raw("POST", "/v1/x", {"i": 0}) == {"a": 1}
    assert client.call_raw("POST", "/v1/x", {"i": 1}) == {"echo": {"i": 1}}
    assert server.connections == 2 and len(server.requests) == 2
    monkeypatch.setattr(connection, "MAX_BODY_BYTES", 1000)  # an answer to the close may not grow without end
    endless = serve(lambda n: [answer(b"x" * 600), answer(b"x" * 600), None])
    with pytest.raises(KVStoreError) as info:
        JsonHttp(endless.url, timeout_s=5).call_raw("POST", "/v1/x", {"i": 0})
    assert info.value.kind == "unavailable"
