"""One HTTP/1.1 keep-alive connection, as `kvstore.client.http.JsonHttp` keeps them.

    conn = Connection(host, port, ssl_context_or_None)
    conn.connect(connect_timeout_s, read_timeout_s)
    response = conn.exchange("POST", "/v1/lookup", body_bytes, {"content-type": "application/json"})
    response.status, response.headers["retry-after"], response.body, response.will_close
    closed_by_peer(conn)   # an idle connection the server closed: not to be reused

A request is written in one send; the answer is parsed out of one receive buffer: its head split
on CRLF (names lowercased), its body by Content-Length, by chunks, or up to the close. 1xx answers
are skipped. A request that cannot be written as given raises `Unsendable` before anything is
sent; an answer that is not HTTP/1.x ValueError, a server that closed before answering
`Disconnected`, the rest OSError.
"""

from __future__ import annotations

import re
import select
import socket
import ssl

MAX_HEAD_BYTES = 64 << 10  # an answer's status line and headers; more is not a kvstore server
RECV_BYTES = 64 << 10
CONTROL = re.compile(r"[\x00-\x20\x7f]")  # not in a request target
LINE_BREAK = re.compile(r"[\x00\r\n]")  # not in a header
OWN_HEADERS = ("host", "content-length", "transfer-encoding")  # a request's framing: this class writes it
MAX_BODY_BYTES = 1 << 30  # an answer said to be larger is not a kvstore server's
TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a method or a header name
DIGITS = re.compile(r"[0-9]+")
HEX = re.compile(rb"[0-9a-fA-F]+")


class Disconnected(ConnectionError):
    """The server closed the connection before any byte of its answer: it may never have read the
    request (an idle keep-alive connection it had closed), so a reused connection asks again."""


class Unsendable(ValueError):
    """A request that cannot be written as HTTP/1.1 as given (a line break in a header, a space in
    the path, a character outside latin-1): the caller's mistake, nothing was sent."""


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, will_close: bool) -> None:
        self.status, self.headers, self.body, self.will_close = status, headers, body, will_close


class Connection:
    """One HTTP/1.1 keep-alive connection (TLS with `context`): a request written in one send, its
    answer parsed out of one receive buffer."""

    def __init__(self, host: str, port: int | None, context: ssl.SSLContext | None = None) -> None:
        default = 443 if context is not None else 80
        self.host, self.port, self.context = host, port if port is not None else default, context
        name = f"[{host}]" if ":" in host else host  # an IPv6 address
        self.host_header = name if self.port == default else f"{name}:{self.port}"
        self.sock: socket.socket | None = None
        self.heard = False  # a byte of the last request's answer arrived
        self._buffer = bytearray()

    def connect(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(read_timeout_s)
        except BaseException:
            sock.close()
            raise
        self.sock, self._buffer = sock, bytearray()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def exchange(self, method: str, target: str, content: bytes | None, headers: dict[str, str]) -> Response:
        """Send one request and read its whole answer (1xx answers skipped). Raises Unsendable
        (before sending) for a request that cannot be written as given, Disconnected when the
        server closed the connection before answering, ValueError for an answer that is not
        HTTP/1.x, OSError for the rest."""
        if CONTROL.search(target) or not TOKEN.fullmatch(method):
            raise Unsendable(f"a request line with spaces or control characters: {method[:20]!r} {target[:100]!r}")
        lines = [f"{method} {target} HTTP/1.1", f"host: {self.host_header}"]
        for name, value in headers.items():
            if not TOKEN.fullmatch(name) or LINE_BREAK.search(value):
                raise Unsendable(f"a header that is not one line of a name and a value: {name[:50]!r}")
            if name.lower() not in OWN_HEADERS:
                lines.append(f"{name}: {value}")
        if content is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"content-length: {len(content or b'')}")
        try:
            head = "\r\n".join(lines).encode("latin-1")
        except UnicodeEncodeError:
            raise Unsendable("a request line or header outside latin-1") from None
        self.heard = False
        self.sock.sendall(head + b"\r\n\r\n" + (content or b""))
        while True:
            status, version, fields = self._head()
            if status >= 200:  # a 1xx is followed by the answer
                break
        connection = fields.get("connection", "").lower()
        close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        if method == "HEAD" or status in (204, 304):
            return Response(status, fields, b"", close)
        codings = [c.strip().lower() for c in fields["transfer-encoding"].split(",")] \
            if "transfer-encoding" in fields else []
        if codings and codings[-1] == "chunked":  # a length beside it means nothing; the connection ends
            return Response(status, fields, self._chunks(), close or "content-length" in fields)
        if "content-length" in fields and not codings:
            said = fields["content-length"]
            if not DIGITS.fullmatch(said) or int(said) > MAX_BODY_BYTES:
                raise ValueError(f"content-length {said[:30]!r}")
            return Response(status, fields, self._take(int(said)), close)
        return Response(status, fields, self._rest(), True)  # read to the close

    def _head(self) -> tuple[int, str, dict[str, str]]:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ValueError(f"an answer's head longer than {MAX_HEAD_BYTES} bytes")
            if not self._receive():
                if self.heard:
                    raise ConnectionError("the server closed the connection in the middle of its answer")
                raise Disconnected("the server closed the connection without answering")
        head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[:end + 4]
        version, _, rest = head[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ValueError(f"not an HTTP/1.x answer: {head[0][:100]!r}")
        fields: dict[str, str] = {}
        for line in head[1:]:
            name, colon, value = line.partition(":")
            if not colon or not TOKEN.fullmatch(name):
                raise ValueError(f"not a header line: {line[:100]!r}")
            name, value = name.lower(), value.strip()
            if name in fields:  # a repeated header is one list; two lengths that differ frame nothing
                if name == "content-length" and value != fields[name]:
                    raise ValueError("two content-lengths")
                value = value if name == "content-length" else f"{fields[name]}, {value}"
            fields[name] = value
        return int(rest[:3]), version, fields

    def _receive(self) -> int:
        data = self.sock.recv(RECV_BYTES)
        self._buffer += data
        self.heard = self.heard or bool(data)
        return len(data)

    def _take(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if not self._receive():
                raise ConnectionError("the server closed the connection in the middle of its answer")
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ValueError("a chunk's size line too long")
            if not self._receive():
                raise ConnectionError("the server closed the connection in the middle of its answer")
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    def _chunks(self) -> bytes:
        body = bytearray()
        while True:
            said = self._line().split(b";", 1)[0].strip()  # a size, then maybe an extension
            if not HEX.fullmatch(said):
                raise ValueError(f"not a chunk size: {said[:20]!r}")
            size = int(said, 16)
            if size == 0:
                while self._line():  # trailers, up to the empty line
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise ValueError(f"chunks of more than {MAX_BODY_BYTES} bytes")
            body += self._take(size)
            if self._take(2) != b"\r\n":
                raise ValueError("a chunk not followed by CRLF")

    def _rest(self) -> bytes:
        while self._receive():
            if len(self._buffer) > MAX_BODY_BYTES:
                raise ValueError(f"an answer of more than {MAX_BODY_BYTES} bytes")
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    def has_stray_bytes(self) -> bool:
        """Bytes past the last answer: the connection is out of step and must not be reused."""
        return bool(self._buffer)


def closed_by_peer(conn: Connection) -> bool:
    """An idle keep-alive connection the server has closed (or sent stray bytes on) is readable."""
    if conn.sock is None:
        return False  # not connected yet: the exchange opens it
    if conn.has_stray_bytes() or (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
        return True
    try:
        poller = select.poll()  # select() refuses descriptors past 1023
        poller.register(conn.sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
