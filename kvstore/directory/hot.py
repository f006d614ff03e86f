"""The hot calls: lookup, prepare/complete store, prepare/complete load.

Bodies are decoded by msgspec (`wire.py`) and answers encoded once from plain
values; no pydantic model is built per block. A lookup runs on the event loop
(it only reads the in-memory index); the others wait for the writer in the
thread pool. Until the index is built every hot call answers 503, which a
connector treats as a miss.

The OpenAPI document describes these routes with the pydantic specs of
`kvstore.core.specs` (`document_bodies`), which define the same fields.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.directory import wire
from kvstore.directory.service import DirectoryService

log = logging.getLogger(__name__)
_BODIES: dict[str, type[BaseModel]] = {}  # operation path -> the spec its body follows


def _body(path: str, model: type[BaseModel]) -> dict:
    _BODIES[path] = model
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _answer(value) -> Response:
    return Response(wire.encode(value), media_type="application/json")


def hot_routes(service: DirectoryService) -> APIRouter:
    r = APIRouter()

    async def body(request: Request, kind):
        if not service.index.ready:
            raise KVStoreError("unavailable", "the directory is building its lookup index")
        return wire.decode(await request.body(), kind)

    @r.post("/v1/lookup", response_model=specs.LookupResult, openapi_extra=_body("/v1/lookup", specs.LookupRequest))
    async def lookup(request: Request) -> Response:
        req = await body(request, wire.Lookup)
        return _answer(service.lookup(req.namespace_id, req.hashes, req.locations))

    @r.post("/v1/store/prepare", response_model=specs.StorePrepared,
            openapi_extra=_body("/v1/store/prepare", specs.PrepareStore))
    async def prepare_store(request: Request) -> Response:
        req = await body(request, wire.PrepareStore)
        return _answer(await run_in_threadpool(service.prepare_store, req))

    @r.post("/v1/store/complete", response_model=specs.StoreCompleted,
            openapi_extra=_body("/v1/store/complete", specs.CompleteStore))
    async def complete_store(request: Request) -> Response:
        req = await body(request, wire.CompleteStore)
        done = await run_in_threadpool(service.store.complete, req)
        return _answer({"committed": done.committed, "rolled_back": done.rolled_back})

    @r.post("/v1/load/prepare", response_model=specs.LoadPrepared,
            openapi_extra=_body("/v1/load/prepare", specs.PrepareLoad))
    async def prepare_load(request: Request) -> Response:
        req = await body(request, wire.PrepareLoad)
        batch = await run_in_threadpool(service.prepare_loads, req.namespace_id, [req.hashes], req.reader)
        return _answer({"token": batch["token"], "expires_at": batch["expires_at"], "blocks": batch["chains"][0]})

    @r.post("/v1/load/prepare-batch", response_model=specs.LoadsPrepared,
            openapi_extra=_body("/v1/load/prepare-batch", specs.PrepareLoads))
    async def prepare_loads(request: Request) -> Response:
        req = await body(request, wire.PrepareLoads)
        return _answer(await run_in_threadpool(service.prepare_loads, req.namespace_id, req.chains, req.reader))

    @r.post("/v1/load/complete", response_model=specs.LoadCompleted,
            openapi_extra=_body("/v1/load/complete", specs.CompleteLoad))
    async def complete_load(request: Request) -> Response:
        req = await body(request, wire.CompleteLoad)
        done = await run_in_threadpool(service.loads.complete, req)
        return _answer({"released": done.released, "invalidated": done.invalidated})

    return r


MAX_BODY = 32 << 20  # bytes of one request body


class LookupFastPath:
    """ASGI in front of the app: `POST /v1/lookup` answered straight from the index, without the
    framework's routing, request and response objects (they cost more than the lookup itself).
    The FastAPI route of the same path stays as its documentation and does the same."""

    def __init__(self, app, service: DirectoryService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/lookup" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        status, payload = 200, b""
        try:
            body = await _read_body(receive)
            if not self.service.index.ready:
                raise KVStoreError("unavailable", "the directory is building its lookup index")
            req = wire.decode(body, wire.Lookup)
            payload = wire.encode(self.service.lookup(req.namespace_id, req.hashes, req.locations))
        except KVStoreError as exc:
            status, payload = exc.http_status, wire.encode(exc.to_body())
        except Exception as exc:  # a bug: the same answer as every other route's
            log.exception("unhandled error in a lookup")
            status, payload = 500, wire.encode(KVStoreError("internal", type(exc).__name__).to_body())
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive) -> bytes:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise KVStoreError("invalid", f"request body over {MAX_BODY} bytes")
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
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
