"""The directory's process: a replica's parts (`build.py`), its election and background thread,
behind HTTP.

    create_app(settings | parts) -> ASGI app   # `.state.parts` (and `.state.service`, `.state.tokens`,
                                               # `.state.leader`), `.fastapi`
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvstore.directory.process.build import Parts, build
from kvstore.directory.http.auth import Guard, RateLimit, Tokens
from kvstore.directory.http.hot import HotCalls, HotPath, document_bodies, hot_routes
from kvstore.directory.http.routes import (ERRORS, add_error_handlers, admin_routes, engine_routes, health_routes,
                                           namespace_routes, token_routes, worker_routes)
from kvstore.directory.replica.leader import Leader
from kvstore.directory.replica.service import DirectoryService
from kvstore.directory.settings import DirectorySettings

log = logging.getLogger(__name__)
# A thread holding the GIL gives it up after this long when another waits for it: the writer and
# saves in the thread pool get it while the event loop answers lookups (Python's default, 5 ms,
# starves them under a lookup load). Tier-sized work (a policy built from SQL, a dry run, a prepare
# of 100,000 blocks) takes the GIL back every time the event loop makes a system call, and the loop
# then waits up to this long for it again: such work rests while calls come (`core/pace.py`); 0.1 ms
# gave lookups' p99 beside it no clear gain over 0.5 ms.
GIL_SWITCH_S = 0.0005
TOKENS_RELOAD_S = 5.0


def create_app(settings: DirectorySettings | Parts | None = None):
    """The directory as an ASGI app: FastAPI behind the hot calls' path. `.state.parts` are the
    replica's parts, `.fastapi` the framework app (routes, OpenAPI)."""
    app = create_fastapi(settings)
    settings = app.state.parts.settings
    guard = Guard(app.routes, app.state.tokens, settings.require_auth, settings.open_metrics,
                  RateLimit(settings.engine_rate, settings.engine_burst))
    fast = HotPath(app, app.state.hot, guard, app.state.service.metrics, app.state.leader)
    fast.state, fast.fastapi = app.state, app
    return fast


def create_fastapi(settings: DirectorySettings | Parts | None = None) -> FastAPI:
    parts = settings if isinstance(settings, Parts) else build(settings)
    service, tokens, leader = parts.service, parts.tokens, parts.leader

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        stop = threading.Event()
        reaper = threading.Thread(target=_background, args=(service, leader, tokens, stop), name="reaper",
                                  daemon=True)
        reaper.start()
        yield
        stop.set()
        reaper.join(timeout=5)
        service.flush()
        leader.close()
        _app.state.hot.close()
        parts.close()

    sys.setswitchinterval(GIL_SWITCH_S)
    app = FastAPI(title="kvstore directory", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.parts = parts
    app.state.service, app.state.tokens, app.state.leader = service, tokens, leader
    add_error_handlers(app)
    for router in (health_routes(service, parts.admin, leader), namespace_routes(parts.namespaces),
                   worker_routes(service.membership), engine_routes(service), admin_routes(parts.admin),
                   token_routes(tokens)):
        app.include_router(router, responses=ERRORS)
    app.state.hot = HotCalls(service)
    app.include_router(hot_routes(app.state.hot), responses=ERRORS)
    document_bodies(app)
    return app


def _background(service: DirectoryService, leader: Leader, tokens: Tokens, stop: threading.Event) -> None:
    """Build the index (readyz answers 503 until then); the leader reaps every tick; every replica
    reads the tokens again every TOKENS_RELOAD_S (the leader may have changed them)."""
    loaded = [time.monotonic()]

    def reap() -> None:
        try:
            service.reap()
        except Exception:  # the loop must survive a bad tick (e.g. database briefly away)
            log.exception("reaper tick failed")

    def refresh() -> None:
        if time.monotonic() - loaded[0] > TOKENS_RELOAD_S:
            try:
                tokens.load()
                loaded[0] = time.monotonic()
            except Exception:
                log.exception("reading the tokens again failed")
    try:
        leader.run(stop, reap, refresh)
    except Exception:
        log.exception("the directory's background thread stopped")
