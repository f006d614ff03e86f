"""`kvstore pd-proxy` between two stand-ins for vLLM's OpenAI server (in this process): the prefill
instance gets the request for one token with a new hand-off, the decode instance gets it as the
client sent it with what the prefill instance answered, and the client gets the decode
instance's answer, streamed when it asked; credentials, bounds and failures."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvstore.cli.pd_proxy import MAX_BODY, Backends, PDProxy


class FakeVllm:
    """Records the bodies it gets; answers a completion (with kv_transfer_params when it prefills),
    or a server-sent event stream when asked to stream."""

    def __init__(self, prefill: bool, status: int = 200) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                fake.auth.append(self.headers.get("authorization"))
                if body.get("stream"):
                    self.send_response(status)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    for i in range(3):
                        self.wfile.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                answer = {"choices": [{"text": "P" if prefill else "decoded"}]}
                if prefill:
                    answer["kv_transfer_params"] = {**body["kv_transfer_params"], "namespace_id": "0" * 16,
                                                    "num_tokens": 7, "do_remote_prefill": True}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                data = b'{"data": [{"id": "tiny"}]}'
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pd():
    prefill, decode = FakeVllm(prefill=True), FakeVllm(prefill=False)
    proxy = PDProxy(Backends([prefill.url]), Backends([decode.url]), api_key="k" * 24, handoff_timeout_s=5)
    proxy.start()
    yield proxy, prefill, decode
    proxy.stop()
    prefill.stop()
    decode.stop()


AUTH = {"authorization": "Bearer " + "k" * 24}


def test_a_completion_prefills_for_one_token_then_decodes_with_the_handoff(pd):
    proxy, prefill, decode = pd
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 50, "stream": False}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, headers=AUTH, timeout=10)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    asked = prefill.bodies[0]
    assert (asked["max_tokens"], asked["stream"], asked["prompt"]) == (1, False, "hello")
    handoff = asked["kv_transfer_params"]
    assert handoff["do_remote_decode"] is True and handoff["handoff_id"].startswith("pd-")
    sent = decode.bodies[0]
    assert (sent["max_tokens"], sent["prompt"]) == (50, "hello")  # what the client asked
    assert sent["kv_transfer_params"] == {"handoff_id": handoff["handoff_id"], "do_remote_decode": False,
                                          "do_remote_prefill": True, "namespace_id": "0" * 16, "num_tokens": 7,
                                          "handoff_timeout_s": 5}  # the prefill instance's answer
    assert prefill.auth[0] == decode.auth[0] == AUTH["authorization"]  # the client's credential, passed on
    again = httpx.post(proxy.url + "/v1/completions", json=body, headers=AUTH, timeout=10)
    assert again.status_code == 200
    assert prefill.bodies[1]["kv_transfer_params"]["handoff_id"] != handoff["handoff_id"]  # one id per request


def test_a_stream_comes_back_as_the_decode_instance_sends_it(pd):
    proxy, prefill, decode = pd
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert answer.headers["content-type"] == "text/event-stream"
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    asked = prefill.bodies[0]
    assert (asked["max_completion_tokens"], asked["stream"], "stream_options" in asked) == (1, False, False)
    assert decode.bodies[0]["stream"] is True and decode.bodies[0]["max_completion_tokens"] == 9


def test_credentials_bounds_and_bad_input_are_refused(pd):
    proxy, prefill, decode = pd
    url = proxy.url + "/v1/completions"
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k" * 24}):
        answer = httpx.post(url, json={"prompt": "x"}, headers=headers, timeout=10)
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
    assert httpx.get(proxy.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(proxy.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"] == "tiny"
    assert httpx.get(proxy.url + "/healthz", timeout=10).json() == {"status": "ok"}  # open, for probes
    for content in (b"not json", b"[1, 2]"):
        assert httpx.post(url, content=content, headers=AUTH, timeout=10).status_code == 400
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:  # what httpx will not send
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nauthorization: {AUTH['authorization']}\r\n"
                     "content-length: +2\r\n\r\n{}".encode())
        assert sock.recv(65536).split(b" ", 2)[1] == b"400"
    assert httpx.post(url, content=b"x" * (MAX_BODY + 1), headers=AUTH, timeout=30).status_code == 413
    assert httpx.post(proxy.url + "/v1/embeddings", json={}, headers=AUTH, timeout=10).status_code == 404
    assert prefill.bodies == [] and decode.bodies == []  # nothing refused reached an instance


def test_a_failed_prefill_still_decodes_and_an_unreachable_decode_is_a_502():
    broken, decode = FakeVllm(prefill=True, status=500), FakeVllm(prefill=False)
    proxy = PDProxy(Backends([broken.url]), Backends([decode.url]))
    proxy.start()
    try:
        forged = {"handoff_id": "someone-elses", "do_remote_prefill": True, "handoff_timeout_s": 600}
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                                 "kv_transfer_params": forged}, timeout=10)
        # D computes it all; a client's own kv_transfer_params reach neither instance
        assert answer.status_code == 200 and "kv_transfer_params" not in decode.bodies[0]
        assert broken.bodies[0]["kv_transfer_params"]["handoff_id"].startswith("pd-")
        decode.stop()
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert answer.status_code == 502 and answer.json()["error"]["type"] == "server_error"
        assert decode.url not in answer.text  # the instances' addresses stay in the proxy's log
    finally:
        proxy.stop()
        broken.stop()
    with pytest.raises(ValueError, match="not an http"):
        Backends(["ftp://x"])


def test_the_command_refuses_an_open_bind_without_a_key_and_bad_urls():
    from typer.testing import CliRunner

    from kvstore.cli.main import app

    runner = CliRunner()
    open_bind = runner.invoke(app, ["pd-proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                    "--host", "0.0.0.0"])
    assert open_bind.exit_code == 2 and "needs --api-key" in open_bind.output
    bad = runner.invoke(app, ["pd-proxy", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert bad.exit_code == 2 and "not an http(s)://HOST:PORT URL" in bad.output
