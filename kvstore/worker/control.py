"""The worker's control endpoint: the directory asks it to allocate and free pages.

Only the directory may call it: every request but /healthz and the pushes carries the secret this
worker registered with (`Authorization: Bearer <secret>`); anything else is a 401. Engines call the
pushes with what the directory signed for them with that secret (`kvstore.core.push`); a push that
does not match it is a 403. With a certificate and key it serves HTTPS.

    POST /v1/grant  GrantRequest -> GrantResult   (page credit: many free pages of a memory tier at once)
    POST /v1/alloc  AllocRequest -> AllocResult   (pages tagged with a token: for directories from
                                                    before the worker placed its moves' NVMe pages)
    POST /v1/free   FreeRequest  -> {"freed": n}   (only pages of the matching token; or all of a
                                                    token's NVMe pages)
    POST /v1/move   MoveRequest  -> MoveResult     (copy blocks between this worker's tiers, or into
                                                    another worker's DRAM; NVMe destinations placed
                                                    here and named in the answer)
    POST /v1/verify VerifyRequest -> VerifyResult  (do replicas still hash to their checksums?)
    POST /v1/fence  FenceRequest -> FenceResult    (has every move under these tokens stopped? then none starts)
    POST /v1/push   PushRequest -> PushResult      (an engine: WRITE leased DRAM blocks into its memory)
    POST /v1/push/forget ForgetEngine -> {"quiet": b} (an engine: no push into its old memory, from now on)
    GET  /healthz
    GET  /metrics   Prometheus text; open with `open_metrics`, else it needs the metrics token (or the secret)

Plain `http.server`: control traffic is a few small requests per store, and the
worker stays free of web-framework dependencies. Bounded: at most MAX_CONNECTIONS
connections are served at once (more wait to be accepted), an idle connection is
closed after IDLE_TIMEOUT_S, a body is at most MAX_BODY bytes, and every request
gets an answer with an error body, a bug included.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler

from pydantic import ValidationError

from kvstore.core import moving, page_calls, push, specs
from kvstore.core.errors import KVStoreError, error_list
from kvstore.core.pages import PageAllocator
from kvstore.core.servers import BoundedServer, BoundedServer6
from kvstore.core.sizes import body_length
from kvstore.core.tiers import MEMORY
from kvstore.worker.fencing import MoveFence
from kvstore.worker.metrics import WorkerMetrics
from kvstore.worker.pushes import Pushes

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 60.0
MAX_BODY = 64 << 20
PUSH_BODY = 1 << 20  # an engine's push: its runs and, now and then, its NIXL metadata
MAX_ENGINE_CALLS = 8  # engines' pushes and forgets served at once (each waits on NIXL); more are a 503 at once
ENGINE_READ_TIMEOUT_S = 10.0  # an engine's whole body must arrive within this, or its call ends
COUNTED = ("/v1/grant", "/v1/alloc", "/v1/free", "/v1/move", "/v1/verify", "/v1/fence", "/v1/push", "/v1/push/forget",
           "/healthz", "/metrics")
ENGINE_ROUTES = ("/v1/push", "/v1/push/forget")  # signed by the directory, not called by it


class ControlServer:
    def __init__(self, allocators: dict[str, PageAllocator], host: str = "127.0.0.1", port: int = 0,
                 mover=None, on_free=None, after_free=None, object_tiers: dict | None = None, verifier=None,
                 max_connections: int = MAX_CONNECTIONS, secret: str | None = None,
                 tls: tuple[str, str] | None = None, metrics: WorkerMetrics | None = None,
                 open_metrics: bool = False, metrics_token: str | None = None, advertise: str | None = None,
                 fence: MoveFence | None = None, pushes: Pushes | None = None) -> None:
        """`on_free(kind, token, runs)`: pages given back (runs None: every page of the token);
        `after_free()`: once a free request's pages are all given back, if any were of a durable tier
        (one manifest sync for them all);
        `secret`: what every call must carry (None: no check, for tests in one process);
        `tls`: (certificate file, key file) to serve HTTPS; `metrics`: what GET /metrics serves, to
        anyone with `open_metrics`, else to callers with `metrics_token` or the secret; `advertise`:
        the host in `url` when it is not the bound address; `fence`: the moves running here (shared with
        the mover, which marks those whose NIXL requests did not finish); `pushes`: engines' pushed
        loads (None: refused)."""
        self.allocators = allocators
        self.secret = secret
        self.metrics = metrics or WorkerMetrics()
        self.open_metrics = open_metrics
        self.metrics_token = metrics_token
        self.object_tiers = object_tiers or {}  # kind -> callable(name, token) deleting an object
        self.mover = mover  # callable MoveRequest -> MoveResult, or None: no moves here
        self.on_free = on_free  # callable (kind, token, runs) after pages are given back
        self.after_free = after_free  # callable () once a free request is done
        self.verifier = verifier  # callable VerifyRequest -> VerifyResult, or None: nothing verified here
        self.fence = fence or MoveFence()
        self.pushes = pushes
        self.engine_calls = threading.BoundedSemaphore(MAX_ENGINE_CALLS)
        handler = type("Handler", (_Handler,), {"control": self})
        server_class = BoundedServer6 if ":" in host else BoundedServer  # an IPv6 address
        self._server = server_class((host, port), handler, max_connections)
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            # the handshake runs on the connection's own thread, not in the accept loop
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
            self.scheme = "https"
        self.host, self.port = self._server.server_address[:2]
        self.advertised = advertise or self.host
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.advertised}]" if ":" in self.advertised else self.advertised  # an IPv6 address
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def authorized(self, header: str | None) -> bool:
        if self.secret is None:
            return True
        return _bearer(header, self.secret)

    def may_scrape(self, header: str | None) -> bool:
        return self.open_metrics or bool(self.metrics_token and _bearer(header, self.metrics_token)) \
            or (self.secret is not None and _bearer(header, self.secret))

    def render_metrics(self) -> bytes:
        tiers = {kind: (a.num_pages * a.page_bytes, (a.num_pages - a.free_pages) * a.page_bytes)
                 for kind, a in self.allocators.items()}
        return self.metrics.render(tiers)

    def allocate(self, req: page_calls.AllocRequest) -> page_calls.AllocResult:
        if req.kind in self.object_tiers:  # objects need no pages: one per block, unbounded
            return page_calls.AllocResult(runs=[[] for _ in req.sizes])
        allocator = self._allocator(req.kind)  # sizes are positive and bounded (`AllocRequest`)
        return page_calls.AllocResult(runs=[allocator.allocate(req.token, nbytes) for nbytes in req.sizes])

    def new_epoch(self) -> None:
        """The worker joins under a new epoch: its memory tiers (DRAM and HBM) start empty, every page
        granted or allocated under the old one free again (the directory forgets those replicas)."""
        for kind, allocator in self.allocators.items():
            if kind in MEMORY:
                allocator.reset()

    def grant(self, req: page_calls.GrantRequest) -> page_calls.GrantResult:
        if req.kind not in ("hbm", "dram"):
            raise KVStoreError("invalid", "only memory tiers are granted", tier=req.kind)
        return page_calls.GrantResult(runs=self._allocator(req.kind).grant(req.token, req.max_pages))

    def free(self, req: page_calls.FreeRequest) -> int:
        freed, durable = 0, False  # durable: pages of a tier that keeps a record (after_free writes it)
        try:
            for item in req.items:
                if item.object is not None:
                    for delete in self.object_tiers.values():
                        delete(item.object, item.token)
                    freed += 1
                    continue
                if item.all_pages:
                    released = self._release(item.token)
                    freed, durable = freed + released, durable or released > 0
                    continue
                for kind, allocator in self.allocators.items():
                    if allocator.free(item.token, item.runs):
                        freed += sum(r.count for r in item.runs)
                        durable = durable or kind not in MEMORY
                        if self.on_free:
                            self.on_free(kind, item.token, item.runs)
                        break
                else:
                    log.warning("free of pages not held by token %s ignored", item.token)
        finally:
            if durable and self.after_free:
                self.after_free()
        return freed

    def _release(self, token: str) -> int:
        """Every page of a durable tier held by `token` (a move's destinations the directory never
        learnt the pages of) goes back, and a move under the token that arrives later is refused:
        nothing could give back the pages it would take."""
        self.fence.fence([token])
        freed = 0
        for kind, allocator in self.allocators.items():
            runs = allocator.release(token) if kind not in MEMORY else []
            if runs:
                freed += sum(count for _, count in runs)
                if self.on_free:
                    self.on_free(kind, token, None)
        return freed

    def move(self, req: moving.MoveRequest) -> moving.MoveResult:
        if self.mover is None:
            raise KVStoreError("not_found", "this worker has no tier to move blocks to")
        tokens = {item.dst_token for item in req.items}
        if not self.fence.begin(tokens):
            n = len(req.items)
            return moving.MoveResult(ok=[False] * n, errors=["the directory settled this move without it"] * n,
                                    codes=["expired"] * n)
        try:
            if not any(item.allocate for item in req.items):
                return self.mover(req)
            return self._move_placed(req)
        finally:
            self.fence.end(tokens)

    def _move_placed(self, req: moving.MoveRequest) -> moving.MoveResult:
        """A move whose NVMe destinations this worker places: their pages are taken under each item's
        token, the items that got them go to the mover, and the answer names the pages per item (the
        directory records them, or gives them back)."""
        expired = req.expires_at is not None and time.time() >= req.expires_at
        nvme = self.allocators.get("nvme")
        items, runs, refused = list(req.items), [None] * len(req.items), {}
        by_token: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if item.allocate:
                by_token.setdefault(item.dst_token, []).append(i)
        for token, members in by_token.items():
            for i, pairs in zip(members, nvme.allocate_many(token, [items[i].nbytes for i in members])
                                if nvme is not None and not expired else [None] * len(members)):
                if pairs is None:
                    refused[i] = "this worker has no NVMe tier" if nvme is None else \
                        "no free NVMe pages for this block" if not expired else "the move's deadline passed"
                    continue
                runs[i] = [specs.PageRun(first=f, count=c) for f, c in pairs]
                items[i] = items[i].model_copy(update={"dst_runs": runs[i], "allocate": False})
        sent = [i for i in range(len(items)) if i not in refused]
        answer = self.mover(req.model_copy(update={"items": [items[i] for i in sent]})) if sent else None
        ok, errors = [False] * len(items), [refused.get(i) for i in range(len(items))]
        codes = ["expired" if expired else "failed"] * len(items)
        for k, i in enumerate(sent):
            ok[i], errors[i] = answer.ok[k], answer.errors[k]
            codes[i] = answer.codes[k] if answer.codes else "ok" if answer.ok[k] else "failed"
        return moving.MoveResult(ok=ok, errors=errors, codes=codes, dst_runs=runs)

    def push(self, req: push.PushRequest) -> push.PushResult:
        if self.pushes is None:
            raise KVStoreError("not_found", "this worker pushes no loads")
        return self.pushes.push(req)

    def forget_engine(self, req: push.ForgetEngine) -> bool:
        if self.pushes is None:
            raise KVStoreError("not_found", "this worker pushes no loads")
        return self.pushes.forget(req)

    def settle(self, req: moving.FenceRequest) -> moving.FenceResult:
        return moving.FenceResult(settled=self.fence.fence(req.tokens))

    def verify(self, req: moving.VerifyRequest) -> moving.VerifyResult:
        if self.verifier is None:
            return moving.VerifyResult(matches=[None] * len(req.items))
        return self.verifier(req)

    def _allocator(self, kind: str) -> PageAllocator:
        if kind not in self.allocators:
            raise KVStoreError("not_found", f"this worker has no {kind} tier", tier=kind)
        return self.allocators[kind]


def _bearer(header: str | None, secret: str) -> bool:
    """Whether `header` is `Bearer <secret>`, compared in constant time."""
    return header is not None and hmac.compare_digest(header.encode("latin-1", "replace"),
                                                      f"Bearer {secret}".encode())


class _Handler(BaseHTTPRequestHandler):
    control: ControlServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave as separate writes; Nagle would hold the body ~40 ms
    timeout = IDLE_TIMEOUT_S  # an idle keep-alive connection gives its slot back

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path == "/healthz":
            self._answer(200, {"status": "ok"})
        elif self.path == "/metrics":
            if not self.control.may_scrape(self.headers.get("authorization")):
                self._answer(401, KVStoreError("unauthorized", "GET /metrics needs the worker's metrics token "
                                               "(--metrics-token), or start it with --open-metrics").to_body())
                return
            self._answer(200, self.control.render_metrics(), content_type="text/plain; version=0.0.4")
        else:
            self._answer(404, KVStoreError("not_found", f"no route {self.path}").to_body())

    def do_POST(self) -> None:  # noqa: N802
        routes = {"/v1/grant": (page_calls.GrantRequest, lambda b: self.control.grant(b).model_dump()),
                  "/v1/alloc": (page_calls.AllocRequest, lambda b: self.control.allocate(b).model_dump()),
                  "/v1/free": (page_calls.FreeRequest, lambda b: {"freed": self.control.free(b)}),
                  "/v1/move": (moving.MoveRequest, lambda b: self.control.move(b).model_dump()),
                  "/v1/verify": (moving.VerifyRequest, lambda b: self.control.verify(b).model_dump()),
                  "/v1/fence": (moving.FenceRequest, lambda b: self.control.settle(b).model_dump()),
                  "/v1/push": (push.PushRequest, lambda b: self.control.push(b).model_dump(exclude_none=True)),
                  "/v1/push/forget": (push.ForgetEngine, lambda b: {"quiet": self.control.forget_engine(b)})}
        if self.path not in routes:
            self.close_connection = True  # its body was not read
            self._answer(404, KVStoreError("not_found", f"no route {self.path}").to_body())
            return
        model, action = routes[self.path]
        if self.path in ENGINE_ROUTES:  # engines are many: at most MAX_ENGINE_CALLS of them are served at once
            self.close_connection = True
            if not self.control.engine_calls.acquire(blocking=False):
                self._answer(503, KVStoreError("unavailable", f"this worker serves {MAX_ENGINE_CALLS} engine "
                                               "calls at once; read the blocks", retry_after_s=1).to_body(),
                             closing=True)
                return
            try:
                self._serve(model, action, PUSH_BODY, time.monotonic() + ENGINE_READ_TIMEOUT_S)
            finally:
                self.control.engine_calls.release()
            return
        if not self.control.authorized(self.headers.get("authorization")):
            self.close_connection = True
            self._answer(401, KVStoreError("unauthorized", "only the directory this worker registered with may "
                                           "call it").to_body())
            return
        self._serve(model, action, MAX_BODY)

    def _serve(self, model, action, max_body: int, deadline: float | None = None) -> None:
        """Read, check and answer one request body (all of it before `deadline`, when one is given)."""
        try:
            length = body_length(self.headers.get("content-length"), max_body) or 0
            body = model.model_validate_json(self._body(length, deadline))
            self._answer(200, action(body))
        except ValidationError as exc:
            errors = error_list(exc.errors()[:5])
            self._answer(400, KVStoreError("invalid", "bad request body", errors=errors).to_body())
        except KVStoreError as exc:
            if exc.kind in ("invalid", "too_large"):
                self.close_connection = True  # what is left of the body cannot be trusted to frame a request
            self._answer(exc.http_status, exc.to_body())
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the caller left, or stalled, before its answer
            self.close_connection = True
        except Exception as exc:  # a bug: answered, logged, and the connection closed
            log.exception("control %s failed", self.path)
            self.close_connection = True
            self._answer(500, KVStoreError("internal", type(exc).__name__).to_body())

    def _body(self, length: int, deadline: float | None) -> bytes:
        if deadline is None:
            return self.rfile.read(length)
        chunks, got = [], 0
        while got < length:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the body did not arrive in time")
            self.connection.settimeout(left)
            chunk = self.rfile.read1(length - got)
            if not chunk:
                raise ConnectionResetError("the caller closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, headers, an unknown method) in kvstore's body."""
        self.close_connection = True
        code = 405 if code == 501 else code  # no handler for the method
        kind = {404: "not_found", 413: "too_large", 414: "too_large", 431: "too_large"}.get(code, "invalid")
        body = KVStoreError(kind, message or self.responses.get(code, ("",))[0]).to_body()
        self._answer(code, body, reason=message, closing=True)

    def _answer(self, status: int, body: dict | bytes, reason: str | None = None, closing: bool = False,
                content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()
        path = getattr(self, "path", "")  # unset when the request line could not be parsed
        path = path if path in COUNTED else "other"
        self.control.metrics.control_requests.labels(path, str(status)).inc()
        self.send_response(status, reason)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        if closing or self.close_connection:  # the caller learns it cannot send on this connection again
            self.send_header("connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has headers only
            self.wfile.write(data)

    def log_message(self, fmt: str, *args) -> None:
        log.debug("control: " + fmt, *args)
