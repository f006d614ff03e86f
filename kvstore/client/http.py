"""JSON over HTTP/1.1 keep-alive connections, with kvstore's error bodies turned back into KVStoreError.

The hot calls (lookup, prepare/complete of saves and loads) are a few hundred microseconds of
directory work, so the client must cost less than that: connections kept open per calling
thread, Nagle off, each request written in one send and each answer read from one buffer by its
Content-Length (or its chunks, or to the close), with no per-request URL or header machinery.
(An httpx client added about 0.3 ms to every call; the standard library's, which parses headers
as e-mail, about 0.2 ms to a 128-key lookup.)

Several servers: `JsonHttp("http://a:8700,http://b:8700")` sends each call to the server that
answered last; one it cannot reach, or that answers 500 or 503, goes to the back of the order for
a while (1 s, doubling to 30 s while it keeps failing, or what its `Retry-After` says, with up to
25 % jitter so that clients do not come back at once) and the call goes to the next. Only when
every server fails does the caller see the error. A 429 or 503 error carries the server's
`Retry-After` as `retry_after_s` in its context: loops that ask again (hand-off waits) wait that
long; a single call never sleeps on it (an engine's lookup is a miss, not a wait).
"""

from __future__ import annotations

import json
import random
import ssl
import threading
import time
from collections.abc import Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel

from kvstore.client.connection import CONTROL, LINE_BREAK, Connection, Disconnected, Unsendable, closed_by_peer
from kvstore.core.errors import KVStoreError, Unreachable

M = TypeVar("M", bound=BaseModel)
JSON = {"content-type": "application/json"}
MAX_IDLE = 16  # connections kept open per client and server
CONNECT_TIMEOUT_S = 3.0  # with several servers, a host that does not answer costs this, not the read timeout
FAILOVER_STATUSES = (500, 503)  # the server cannot answer now; another one may (502 is a worker's failure)
BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Certificates checked against `ca_file` (or the system's CAs), host names included."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise KVStoreError("invalid", f"cannot read the CA file {ca_file!r}: {exc}") from None


class _Server:
    """One server's address, idle connections and back-off."""

    def __init__(self, url: str, ca_file: str | None) -> None:
        self.url = url.strip().rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or CONTROL.search(parts.path):
            raise KVStoreError("invalid", f"not an http(s) URL: {url.strip()!r}")
        self.context = tls_context(ca_file) if parts.scheme == "https" else None
        self.host, self.port, self.prefix = parts.hostname, parts.port, parts.path
        self.idle: list[Connection] = []
        self.skip_until = 0.0  # monotonic time before which calls go elsewhere
        self.backoff_s = 0.0


class JsonHttp:
    """`base_url`: one URL, or several separated by commas or as a list (tried in turn, see above). `token`
    goes in every request as a bearer credential; `ca_file` (else the system's CAs) checks an
    https server's certificate."""

    def __init__(self, base_url: str | Sequence[str], timeout_s: float = 30.0, token: str | None = None,
                 ca_file: str | None = None) -> None:
        urls = [u for u in (base_url.split(",") if isinstance(base_url, str) else base_url) if u.strip()]
        if not urls:
            raise KVStoreError("invalid", f"not an http(s) URL: {base_url!r}")
        self._servers = [_Server(u, ca_file) for u in urls]
        self._current = 0
        self.timeout_s = timeout_s
        if token and (LINE_BREAK.search(token) or not token.isascii()):
            raise KVStoreError("invalid", "a token with a line break or outside ASCII")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        """The server calls go to now."""
        return self._servers[self._current].url

    def call(self, method: str, path: str, body: BaseModel | None, answer: type[M],
             timeout_s: float | None = None) -> M:
        return answer.model_validate_json(self._request(method, path, body, timeout_s))

    def call_raw(self, method: str, path: str, body: BaseModel | dict | None = None):
        return json.loads(self._request(method, path, body))

    def exchange(self, method: str, target: str, content: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        """One request as given (the target with its query, the body as bytes) to the first server,
        and its status and body whatever they are: what a directory replica that forwards a call
        needs. Raises KVStoreError("unavailable") only when the server cannot be reached."""
        server = self._servers[0]
        return self._exchange(server, method, server.prefix + target, content, headers, self.timeout_s)[:2]

    def _request(self, method: str, path: str, body: BaseModel | dict | None,
                 timeout_s: float | None = None) -> bytes:
        if isinstance(body, BaseModel):
            content, headers = body.model_dump_json().encode(), {**self._headers, **JSON}
        elif body:
            content, headers = json.dumps(body).encode(), {**self._headers, **JSON}
        else:
            content, headers = None, self._headers
        failure: KVStoreError | None = None
        for index in self._order():
            server = self._servers[index]
            try:
                status, payload, retry_after = self._exchange(server, method, server.prefix + path, content,
                                                              headers, timeout_s or self.timeout_s)
            except KVStoreError as exc:  # unreachable (a request that cannot be sent is the caller's error)
                if exc.kind != "unavailable":
                    raise
                failure = exc
                self._failed(server)
                continue
            if 200 <= status < 300:
                self._answered(index)
                return payload
            error = _error(status, payload, server.url + path)
            if retry_after is not None and status in (429, 503):
                error.context.setdefault("retry_after_s", retry_after)
            if status in FAILOVER_STATUSES and len(self._servers) > 1:
                failure = error
                self._failed(server, retry_after)
                continue
            self._answered(index)
            raise error
        raise failure

    def _order(self) -> list[int]:
        """The server that answered last, then the others; those backing off go last."""
        now = time.monotonic()
        n = len(self._servers)
        ring = [(self._current + k) % n for k in range(n)]
        return [i for i in ring if self._servers[i].skip_until <= now] + \
            [i for i in ring if self._servers[i].skip_until > now]

    def _failed(self, server: _Server, retry_after_s: float | None = None) -> None:
        if len(self._servers) == 1:
            return
        with self._lock:
            server.backoff_s = min(MAX_BACKOFF_S, server.backoff_s * 2 or BACKOFF_S)
            wait = max(server.backoff_s, min(MAX_BACKOFF_S, retry_after_s or 0.0))
            server.skip_until = time.monotonic() + wait * random.uniform(1.0, 1.25)

    def _answered(self, index: int) -> None:
        server = self._servers[index]
        if server.backoff_s or index != self._current:
            with self._lock:
                server.backoff_s, server.skip_until = 0.0, 0.0
                self._current = index

    def _exchange(self, server: _Server, method: str, path: str, content: bytes | None, headers: dict[str, str],
                  timeout_s: float) -> tuple[int, bytes, float | None]:
        """One request and its whole response (status, body, its Retry-After in seconds). A reused
        connection that fails before any answer arrived (the server closed it while idle) is retried
        once on a new connection."""
        conn, reused = self._checkout(server, timeout_s)
        try:
            while True:
                try:
                    if conn.sock is None:
                        conn.connect(self._connect_timeout(timeout_s), timeout_s)
                    response = conn.exchange(method, path, content, headers)
                    break
                except Unsendable as exc:  # nothing was sent
                    raise KVStoreError("invalid", str(exc)) from None
                except (Disconnected, ConnectionResetError, BrokenPipeError) as exc:
                    conn.close()
                    if not reused or conn.heard:  # part of an answer came: the request was served
                        raise _unreachable(server, path, exc) from None
                    reused = False
                except (OSError, ValueError) as exc:  # ValueError: not HTTP, or a host name not in ASCII
                    conn.close()
                    raise _unreachable(server, path, exc) from None
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        self._checkin(server, conn)
        return response.status, response.body, retry_after(response.headers.get("retry-after"))

    def _connect_timeout(self, timeout_s: float) -> float:
        """Short when other servers can answer instead; the exchange itself has `timeout_s`."""
        return min(timeout_s, CONNECT_TIMEOUT_S) if len(self._servers) > 1 else timeout_s

    def _checkout(self, server: _Server, timeout_s: float) -> tuple[Connection, bool]:
        """An idle connection to `server` (reused: True), else a new one, not connected yet."""
        with self._lock:
            conn = server.idle.pop() if server.idle else None
        if conn is not None and closed_by_peer(conn):
            conn.close()
        if conn is None:
            conn = Connection(server.host, server.port, server.context)
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
            return conn, True
        return conn, False

    def _checkin(self, server: _Server, conn: Connection) -> None:
        if conn.sock is None:
            return
        with self._lock:
            if len(server.idle) < MAX_IDLE:
                server.idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        for server in self._servers:
            with self._lock:
                idle, server.idle = server.idle, []
            for conn in idle:
                conn.close()


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's seconds (an HTTP date, or nonsense, counts as none)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 86400 else None


def _unreachable(server: _Server, path: str, exc: Exception) -> KVStoreError:
    reason = str(exc) or type(exc).__name__
    return Unreachable(f"cannot reach {server.url}: {reason}", url=server.url + path)


def _error(status: int, payload: bytes, url: str) -> KVStoreError:
    """The server's error body as a KVStoreError (or a generic one for a body that is not ours)."""
    try:
        error = json.loads(payload)
    except ValueError:
        error = None
    if isinstance(error, dict) and "error" in error:
        return KVStoreError.from_body(error)
    return KVStoreError("internal", f"HTTP {status} from {url}", body=payload[:500].decode(errors="replace"))
