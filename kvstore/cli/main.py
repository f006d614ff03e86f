"""`kvstore` CLI entry point. Errors are one clear line and a non-zero exit code."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import nullcontext
from typing import Annotated

import typer
from rich.table import Table

from kvstore import __version__
from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, ago, console, directory, emit, one_line_errors
from kvstore.cli.database import db_app
from kvstore.cli.info import info
from kvstore.cli.maintenance import evict, flush, replicas, write_through
from kvstore.cli.pd_proxy import pd_proxy
from kvstore.cli.prefixes import inspect, lookup
from kvstore.cli.run import up
from kvstore.cli.serve import config_app, directory_app, worker_app
from kvstore.cli.status import status
from kvstore.cli.tokens import tokens_app
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size

app = typer.Typer(help="kvstore: a tiered KV-cache store for LLM inference.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(directory_app, name="directory")
app.add_typer(worker_app, name="worker")
app.add_typer(db_app, name="db")
app.add_typer(tokens_app, name="tokens")
app.add_typer(config_app, name="config")
app.command()(up)
app.command()(info)
app.command()(status)
app.command()(lookup)
app.command()(inspect)
app.command()(evict)
app.command()(flush)
app.command("write-through")(write_through)
app.command()(replicas)
app.command("pd-proxy")(pd_proxy)


def _print_version(wanted: bool) -> None:
    if wanted:
        print(f"kvstore {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """kvstore: a tiered KV-cache store for LLM inference."""


@app.command()
@one_line_errors
def tiers(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Capacity and usage of every tier of every worker."""
    rows = directory(url, token, ca_file).tiers()
    if output == "json":
        print(json.dumps([r.model_dump() for r in rows], indent=2))
        return
    table = Table("worker", "kind", "capacity", "used", "blocks", "KV/used", "page", "watermarks")
    for r in rows:  # KV/used: KV bytes held ÷ bytes of the pages holding them
        table.add_row(r.worker, r.kind, format_size(r.capacity_bytes), format_size(r.used_bytes),
                      str(r.num_blocks), "-" if r.efficiency is None else f"{r.efficiency:.2f}",
                      format_size(r.page_bytes), f"{r.low_watermark:.2f}/{r.high_watermark:.2f}")
    console.print(table)


@app.command()
@one_line_errors
def namespaces(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None,
               output: Output = "table") -> None:
    """Registered namespaces: model, hash scheme, block size, blocks and bytes per tier."""
    rows = directory(url, token, ca_file).namespaces()
    if output == "json":
        print(json.dumps([r.model_dump() for r in rows], indent=2))
        return
    table = Table()
    table.add_column("namespace_id", no_wrap=True, min_width=16)  # the id other commands take: never cut
    for header in ("tenant", "model", "block", "blocks by tier", "write-through", "replicas"):  # hash scheme: --output json
        table.add_column(header)
    for r in rows:
        table.add_row(r.namespace_id, r.tenant, r.model_id + (f"@{r.model_revision}" if r.model_revision else ""),
                      f"{r.block_tokens} tok, {format_size(r.block_nbytes)}",
                      " ".join(f"{k}:{n} ({format_size(r.bytes.get(k, 0))})" for k, n in sorted(r.blocks.items()))
                      or "-", "on" if r.write_through else "", str(r.replicas))
    console.print(table)


workers_app = typer.Typer(help="Registered storage workers: list (the default), drain, undrain.")
app.add_typer(workers_app, name="workers")


@workers_app.callback(invoke_without_command=True)
@one_line_errors
def workers(ctx: typer.Context, url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None,
            output: Output = "table") -> None:
    """Registered storage workers."""
    if ctx.invoked_subcommand is not None:
        return
    rows = directory(url, token, ca_file).workers()
    if output == "json":
        print(json.dumps([r.model_dump(exclude={"agent_metadata"}) for r in rows], indent=2))
        return
    table = Table("name", "state", "epoch", "pid", "url", "agent", "last heartbeat")
    for r in rows:
        table.add_row(r.name, r.state, str(r.epoch), str(r.pid), r.control_url, r.agent_name, ago(r.last_heartbeat))
    console.print(table)


@workers_app.command()
@one_line_errors
def drain(name: Annotated[str, typer.Argument(help="worker name")], url: Url = DEFAULT_URL, token: Token = None,
          ca_file: CaFile = None,
          wait: Annotated[float, typer.Option(help="seconds to wait for the drain to finish; 0 = do not wait")] = 0.0,
          output: Output = "table") -> None:
    """Stop new placements on a worker and move its memory tiers down; it ends `drained`."""
    client = directory(url, token, ca_file)
    info = client.drain(name)
    deadline = time.monotonic() + wait
    with console.status(f"draining {name} …", spinner="dots") if wait > 0 else nullcontext():
        while info.state == "draining" and time.monotonic() < deadline:
            time.sleep(0.5)
            info = client.worker(name)
    emit(output, info.model_copy(update={"agent_metadata": None}), text=f"worker {name}: {info.state}")
    if wait > 0 and info.state != "drained":
        raise KVStoreError("unavailable", f"worker {name} still {info.state} after {wait:g}s "
                           "(pinned blocks wait for their readers or their lease TTL)")


@workers_app.command()
@one_line_errors
def undrain(name: Annotated[str, typer.Argument(help="worker name")], url: Url = DEFAULT_URL, token: Token = None,
            ca_file: CaFile = None, output: Output = "table") -> None:
    """Reverse a drain that has not finished: the worker takes placements again."""
    info = directory(url, token, ca_file).undrain(name)
    emit(output, info.model_copy(update={"agent_metadata": None}), text=f"worker {name}: {info.state}")


@app.command()
@one_line_errors
def stats(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Blocks, replicas, reservations, leases, pins and moves in flight."""
    result = directory(url, token, ca_file).stats()

    def table() -> Table:
        t = Table("", "", show_header=False)
        for name, value in result.model_dump().items():
            t.add_row(name.replace("_", " "), " ".join(f"{k}:{v}" for k, v in sorted(value.items())) or "-"
                      if isinstance(value, dict) else str(value))
        return t
    emit(output, result, table)


def main() -> None:
    # operator commands print what they did; only problems are logged (servers raise this to INFO)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
