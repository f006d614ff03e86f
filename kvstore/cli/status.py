"""`kvstore status`: the cluster at a glance, as `etcdctl endpoint status --cluster` shows etcd's:
every directory replica given in --url (leader or follower, term, how far behind the change log,
ready or why not) and every worker (state, epoch, heartbeat age, tiers used).

Exit codes, as every command's: 0 every replica answered and is ready; 1 the directory refused
the call (a bad token, bad input); 3 a replica could not be reached; 4 a replica answered with a
server error or is not ready.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from kvstore.cli.common import (DEFAULT_URL, EXIT_SERVER, EXIT_UNREACHABLE, CaFile, Output, Token, Url, ago,
                                directory, emit, exit_code, one_line_errors)
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size

Timeout = Annotated[float, typer.Option(min=0.1, max=600.0, help="seconds to wait for each replica's answers")]


def _replica(url: str, token: str | None, ca_file: str | None, timeout_s: float) -> dict:
    row = {"url": url, "role": None, "term": None, "lag_s": None, "indexed_blocks": None, "ready": False,
           "detail": "", "exit": 0}
    client = directory(url, token, ca_file, timeout_s)
    try:
        stats = client.stats()
        row.update(role="leader" if stats.leader else "follower", term=stats.term, lag_s=stats.follower_lag_s,
                   indexed_blocks=stats.indexed_blocks)
        status, payload = client.exchange("GET", "/readyz?workers=0", None, {})
        answer = json.loads(payload) if payload else {}
        row["ready"] = status == 200
        row["detail"] = "" if status == 200 else str(answer.get("detail") or answer.get("reason") or status)
        row["exit"] = 0 if status == 200 else EXIT_SERVER
    except KVStoreError as exc:
        row.update(detail=exc.message, exit=exit_code(exc))
    except ValueError as exc:  # an answer that is not JSON: not a kvstore directory
        row.update(detail=f"not a kvstore directory's answer: {exc}", exit=EXIT_SERVER)
    finally:
        client.close()
    return row


@one_line_errors
def status(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table",
           timeout: Timeout = 5.0) -> None:
    """Every directory replica in --url and every worker: roles, terms, lag, readiness, tiers."""
    urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
    replicas = [_replica(u, token, ca_file, timeout) for u in urls]
    answered = [r["url"] for r in replicas if r["role"] is not None]
    workers, tiers = [], []
    if answered:
        client = directory(",".join(answered), token, ca_file, timeout)
        try:
            workers, tiers = client.workers(), client.tiers()
        except KVStoreError as exc:
            replicas.append({"url": "(workers)", "role": None, "detail": exc.message, "exit": exit_code(exc)})
        finally:
            client.close()
    now = time.time()
    rows = [{"name": w.name, "state": w.state, "epoch": w.epoch, "heartbeat_age_s": round(now - w.last_heartbeat, 1),
             "tiers": {t.kind: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                       for t in tiers if t.worker == w.name}} for w in workers]
    emit(output, {"replicas": [{k: v for k, v in r.items() if k != "exit"} for r in replicas], "workers": rows},
         table=lambda: _tables(replicas, workers, tiers, now))
    worst = max((r["exit"] for r in replicas), default=0)
    if worst:
        raise typer.Exit(worst)


def _tables(replicas: list[dict], workers, tiers, now: float):
    from rich.console import Group

    top = Table()
    top.add_column("directory", no_wrap=True)  # a URL is never cut
    top.add_column("role", no_wrap=True)
    for header in ("term", "lag", "indexed blocks", "ready"):
        top.add_column(header)
    for r in replicas:
        if r["role"] is None:
            top.add_row(r["url"], "unreachable" if r["exit"] == EXIT_UNREACHABLE else "error", "-", "-", "-",
                        r["detail"])
            continue
        top.add_row(r["url"], r["role"], str(r["term"]), f"{r['lag_s']:.1f} s", str(r["indexed_blocks"]),
                    "yes" if r["ready"] else f"no: {r['detail']}")
    bottom = Table("worker", "state", "epoch", "heartbeat", "tiers used")
    for w in workers:
        used = [f"{t.kind} {format_size(t.used_bytes)}" + (f"/{format_size(t.capacity_bytes)}"
                                                           if t.capacity_bytes is not None else "")
                for t in tiers if t.worker == w.name]
        bottom.add_row(w.name, w.state, str(w.epoch), ago(w.last_heartbeat, now), ", ".join(used) or "-")
    return Group(top, bottom)

