"""The hot calls: lookup, prepare/complete store, prepare/complete load.

Bodies are decoded by msgspec (`wire.py`) and answers encoded once from plain
values; no pydantic model is built per block. `HotPath` answers them in front
of FastAPI. Until the index is built every hot call answers 503, which a
connector treats as a miss. On a directory replica that does not lead, every
call but lookups, health, metrics and stats is sent on to the leader as it
came (`replica/leader.py`).

The OpenAPI document describes these routes with the pydantic specs of
`kvstore.core.specs` (`document_bodies`), which define the same fields.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import json
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvstore.core import pace, specs
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import body_length, too_large
from kvstore.directory import wire
from kvstore.directory.db.engine import outage
from kvstore.directory.http.auth import PRINCIPAL, ROUTES, Guard, Principal
from kvstore.directory.metrics import UNMATCHED, DirectoryMetrics
from kvstore.directory.replica.service import DirectoryService

log = logging.getLogger(__name__)
DATA_THREADS = 32  # loads at once (each may wait on a worker); the framework keeps its own 40 threads
_BODIES: dict[str, type[BaseModel]] = {}  # operation path -> the spec its body follows
HEALTH = {("GET", "/healthz"), ("GET", "/readyz")}
LOCAL = HEALTH | {("GET", "/metrics"), ("GET", "/v1/admin/stats"), ("POST", "/v1/lookup"),  # a follower's own
                  ("POST", "/v1/lookup/batch"), ("POST", "/v1/lookup/tokens"),
                  ("POST", "/v1/handoffs/wait")}  # from its index and the change log: no thread waits on the leader
FORWARDED_HEADERS = (b"authorization", b"content-type")


def _body(path: str, model: type[BaseModel]) -> dict:
    _BODIES[path] = model
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


MAX_BODY = 32 << 20  # bytes of one request body (100,000 blocks of a save are about 12 MiB)
MAX_REGISTRATION_BODY = 1 << 30  # a worker's registration lists what survived on its durable tiers
MAX_BODYLESS = 64 << 10  # a GET carries no body worth reading
TOKEN_READ_S = 0.5  # a follower reads the tokens again for one it does not know at most this often


class HotCalls:
    """The hot calls, from a request body to an answer of plain values. A lookup runs on the event
    loop (it only reads the in-memory index); a save's prepare and complete wait for the writer
    without a thread of their own; loads, which may stage blocks through workers, run on a thread."""

    def __init__(self, service: DirectoryService) -> None:
        self.service = service
        # Loads may wait on workers (a promotion, up to the move timeout): they run on threads of
        # their own, so that a hung worker never holds up the framework's threads, which answer
        # heartbeats, lease renewals and health checks.
        self._data = ThreadPoolExecutor(DATA_THREADS, thread_name_prefix="kvstore-load")
        self.by_path = {"/v1/lookup": self.lookup, "/v1/store/prepare": self.prepare_store,
                        "/v1/store/complete": self.complete_store, "/v1/load/prepare": self.prepare_load,
                        "/v1/load/prepare-batch": self.prepare_loads, "/v1/load/complete": self.complete_load}

    def _decode(self, body: bytes, kind):
        if not self.service.ready:
            raise KVStoreError("unavailable", "the directory is building its lookup index", retry_after_s=1)
        return wire.decode(body, kind)

    async def lookup(self, body: bytes, who: Principal):
        req = self._decode(body, wire.Lookup)
        return self.service.lookup(req.namespace_id, req.hashes, req.locations, who.tenants)

    async def prepare_store(self, body: bytes, who: Principal):
        return await self.service.prepare_store_async(self._decode(body, wire.PrepareStore), who.tenants)

    async def complete_store(self, body: bytes, _who: Principal):
        done = await self.service.complete_store_async(self._decode(body, wire.CompleteStore))
        return {"committed": done.committed, "rolled_back": done.rolled_back}

    async def prepare_load(self, body: bytes, who: Principal):
        req = self._decode(body, wire.PrepareLoad)
        batch = await self._on_data_thread(self.service.prepare_loads, req.namespace_id, [req.hashes], req.reader,
                                           who.tenants, who.id if req.push else None)
        answer = {"token": batch["token"], "expires_at": batch["expires_at"], "blocks": batch["chains"][0],
                  "more": batch["more"][0]}
        if batch.get("grants"):
            answer["grants"] = batch["grants"]
        return answer

    async def prepare_loads(self, body: bytes, who: Principal):
        req = self._decode(body, wire.PrepareLoads)
        return await self._on_data_thread(self.service.prepare_loads, req.namespace_id, req.chains, req.reader,
                                          who.tenants)

    async def complete_load(self, body: bytes, _who: Principal):
        done = await self._on_data_thread(self.service.complete_loads, self._decode(body, wire.CompleteLoad))
        return {"released": done.released, "invalidated": done.invalidated}

    async def _on_data_thread(self, call, *args):
        return await asyncio.get_running_loop().run_in_executor(self._data, functools.partial(call, *args))

    def close(self) -> None:
        self._data.shutdown(wait=False, cancel_futures=True)


def hot_routes(calls: HotCalls) -> APIRouter:
    """The hot calls as FastAPI routes: what the OpenAPI document shows. `HotPath` answers the same
    paths first, with the same handlers."""
    r = APIRouter()
    documented = [("/v1/lookup", specs.LookupRequest, specs.LookupResult),
                  ("/v1/store/prepare", specs.PrepareStore, specs.StorePrepared),
                  ("/v1/store/complete", specs.CompleteStore, specs.StoreCompleted),
                  ("/v1/load/prepare", specs.PrepareLoad, specs.LoadPrepared),
                  ("/v1/load/prepare-batch", specs.PrepareLoads, specs.LoadsPrepared),
                  ("/v1/load/complete", specs.CompleteLoad, specs.LoadCompleted)]
    for path, body_spec, answer_spec in documented:
        handler = calls.by_path[path]
        r.add_api_route(path, _route(handler), methods=["POST"], response_model=answer_spec,
                        name=handler.__name__, openapi_extra=_body(path, body_spec))
    return r


def _route(handler):
    async def route(request: Request) -> Response:
        who = request.scope[PRINCIPAL]
        return Response(wire.encode(await handler(await request.body(), who)), media_type="application/json")
    return route


class _TokenReads:
    """A follower's reads of the tokens for calls with one it does not know: one read at a time, each
    serving every call that arrived before it began, at most one per TOKEN_READ_S. The calls wait on
    the event loop, not on threads, so unknown tokens cost no more than a read per interval."""

    def __init__(self, tokens) -> None:
        self.tokens = tokens
        self._lock = asyncio.Lock()
        self._began = float("-inf")  # time.monotonic() when the last read began

    async def after(self, arrived: float) -> None:
        """Returns once a read that began after `arrived` has ended."""
        async with self._lock:
            if self._began > arrived:
                return
            await asyncio.sleep(max(0.0, self._began + TOKEN_READ_S - time.monotonic()))
            self._began = time.monotonic()
            try:
                await run_in_threadpool(self.tokens.load)
            except Exception as exc:  # the database does not answer: the tokens read last stand
                log.warning("reading the tokens again failed: %s", outage(exc) or type(exc).__name__)


class HotPath:
    """ASGI in front of the app: the hot calls answered without the framework's routing, middleware,
    request and response objects (they cost more than a lookup itself)."""

    def __init__(self, app, calls: HotCalls, guard: Guard, metrics: DirectoryMetrics, leader) -> None:
        self.app = app
        self.calls = calls
        self.guard = guard
        self.metrics = metrics
        self.leader = leader
        self._token_reads = _TokenReads(guard.tokens)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method, path = scope["method"], scope["path"]
        route = self.guard.route(method, path)
        answered = [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                answered[0] = message["status"]
            await send(message)
        try:
            await self._serve(scope, receive, sending, route)
        finally:
            if path in self.calls.by_path:
                pace.served()
            self.metrics.observe(route[0] if route else UNMATCHED, method if route else "", answered[0],
                                 time.perf_counter() - started)

    async def _serve(self, scope, receive, send, route) -> None:
        headers = dict(scope["headers"])
        method, path = scope["method"], scope["path"]
        if route is not None and not self.leader.leading:
            if (method, route[0]) not in LOCAL:  # the credential checked here first: no body read for nobody
                try:
                    await self._admit_here(method, path, headers.get(b"authorization"), route)
                except KVStoreError as exc:
                    await _answer(send, exc.http_status, wire.encode(exc.to_body()), _error_headers(exc))
                    return
                await self._forward(scope, receive, send, headers)
                return
        try:  # refused before a byte of the body is read
            who = scope[PRINCIPAL] = self.guard.admit(method, path, headers.get(b"authorization"), route)
            limit = _body_limit(method, path)
            length = body_length(headers.get(b"content-length"), limit)
        except KVStoreError as exc:
            await _answer(send, exc.http_status, wire.encode(exc.to_body()), _error_headers(exc))
            return
        handler = self.calls.by_path.get(path)
        if handler is None or method != "POST":
            if length is None:  # chunked: read it here, bounded, and hand it on whole
                try:
                    receive = _replay(await _read_body(receive, limit), receive)
                except KVStoreError as exc:
                    await _answer(send, exc.http_status, wire.encode(exc.to_body()))
                    return
            await self.app(scope, receive, send)
            return
        try:
            payload = wire.encode(await handler(await _read_body(receive, limit), who))
        except Exception as exc:  # noqa: BLE001 (a refusal, a database outage (503) or a bug (500))
            error = _as_error(exc, path)
            await _answer(send, error.http_status, wire.encode(error.to_body()), _error_headers(error))
            return
        await _answer(send, 200, payload)


    async def _admit_here(self, method: str, path: str, authorization: bytes | None, route) -> Principal:
        """The guard's verdict on a call this follower forwards. A token it does not know may be one
        the leader created since the follower last read the tokens: it reads them again first."""
        arrived = time.monotonic()
        try:
            return self.guard.admit(method, path, authorization, route)
        except KVStoreError as exc:
            if exc.kind != "unauthorized" or not authorization:
                raise
        await self._token_reads.after(arrived)
        return self.guard.admit(method, path, authorization, route)

    async def _forward(self, scope, receive, send, headers: dict) -> None:
        """The call as it came, to the leader, and its answer back (bounded like every body here)."""
        method = scope["method"]
        limit = _body_limit(method, scope["path"])
        try:
            body_length(headers.get(b"content-length"), limit)
            body = await _read_body(receive, limit)
            query = scope.get("query_string", b"")
            target = scope.get("raw_path", scope["path"].encode()).decode("latin-1") + \
                ("?" + query.decode("latin-1") if query else "")
            sent = {k.decode(): v.decode("latin-1") for k, v in headers.items() if k in FORWARDED_HEADERS}
            status, payload = await run_in_threadpool(self.leader.forward, method, target, body, sent)
        except KVStoreError as exc:
            status, payload = exc.http_status, wire.encode(exc.to_body())
        await _answer(send, status, payload, _relayed_headers(status, payload))


def _as_error(exc: Exception, path: str) -> KVStoreError:
    """What a hot call that raised answers: the same as every other route's, Retry-After included."""
    if isinstance(exc, KVStoreError):
        return exc
    error = outage(exc)
    if error is None:
        log.exception("unhandled error in %s", path)
        error = KVStoreError("internal", type(exc).__name__)
    return error


def _body_limit(method: str, path: str) -> int:
    if method == "POST":
        return MAX_REGISTRATION_BODY if path == "/v1/workers" else MAX_BODY
    return MAX_BODY if method == "PUT" else MAX_BODYLESS


async def _answer(send, status: int, payload: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or ())]})
    await send({"type": "http.response.body", "body": payload})


def _error_headers(exc: KVStoreError) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in exc.headers().items()]


def _relayed_headers(status: int, payload: bytes) -> list[tuple[bytes, bytes]]:
    """The error headers of the leader's answer, rebuilt from its body (Retry-After, Allow...)."""
    if status < 400:
        return []
    try:
        body = json.loads(payload)
    except ValueError:
        return []
    return _error_headers(KVStoreError.from_body(body)) if isinstance(body, dict) and "error" in body else []


def _replay(body: bytes, receive):
    """`receive` that gives the body read already, then whatever the connection says next."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _read_body(receive, limit: int) -> bytes:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def document_bodies(app: FastAPI) -> None:
    """Put the specs the hot routes' bodies follow into the OpenAPI components."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _BODIES.values():
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            schema["components"]["securitySchemes"] = {"bearer": {
                "type": "http", "scheme": "bearer", "description": "a kvstore token (`kvstore tokens create`); "
                "each operation's x-kvstore-scopes says which scopes may call it"}}
            for path, operations in schema.get("paths", {}).items():  # bad input is a 400 here, never a 422
                for method, operation in operations.items():
                    operation.get("responses", {}).pop("422", None)
                    scopes = ROUTES.get((method.upper(), path))
                    if scopes:  # the public ones (health) need no credential
                        operation["security"] = [{"bearer": []}]
                        operation["x-kvstore-scopes"] = sorted(scopes)
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
