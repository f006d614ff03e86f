"""`kvstore` CLI entry point. Errors are one clear line and a non-zero exit code."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import nullcontext
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore import __version__
from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, console, directory, one_line_errors
from kvstore.cli.run import up
from kvstore.cli.serve import config_app, directory_app, worker_app
from kvstore.cli.tokens import tokens_app
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size, parse_size

app = typer.Typer(help="kvstore: a tiered KV-cache store for LLM inference.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(directory_app, name="directory")
app.add_typer(worker_app, name="worker")
app.add_typer(db_app, name="db")
app.add_typer(tokens_app, name="tokens")
app.add_typer(config_app, name="config")
app.command()(up)


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
    table = Table("worker", "kind", "capacity", "used", "blocks", "page", "watermarks")
    for r in rows:
        table.add_row(r.worker, r.kind, format_size(r.capacity_bytes), format_size(r.used_bytes),
                      str(r.num_blocks), format_size(r.page_bytes), f"{r.low_watermark:.2f}/{r.high_watermark:.2f}")
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
    for header in ("tenant", "model", "block", "blocks by tier", "write-through"):  # hash scheme: --output json
        table.add_column(header)
    for r in rows:
        table.add_row(r.namespace_id, r.tenant, r.model_id + (f"@{r.model_revision}" if r.model_revision else ""),
                      f"{r.block_tokens} tok, {format_size(r.block_nbytes)}",
                      " ".join(f"{k}:{n} ({format_size(r.bytes.get(k, 0))})" for k, n in sorted(r.blocks.items()))
                      or "-", "on" if r.write_through else "")
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
    now = time.time()
    for r in rows:
        table.add_row(r.name, r.state, str(r.epoch), str(r.pid), r.control_url, r.agent_name,
                      f"{max(0.0, now - r.last_heartbeat):.1f} s ago")
    console.print(table)


@workers_app.command()
@one_line_errors
def drain(name: Annotated[str, typer.Argument(help="worker name")], url: Url = DEFAULT_URL, token: Token = None,
          ca_file: CaFile = None,
          wait: Annotated[float, typer.Option(help="seconds to wait for the drain to finish; 0 = do not wait")] = 0.0
          ) -> None:
    """Stop new placements on a worker and move its memory tiers down; it ends `drained`."""
    client = directory(url, token, ca_file)
    info = client.drain(name)
    deadline = time.monotonic() + wait
    with console.status(f"draining {name} …", spinner="dots") if wait > 0 else nullcontext():
        while info.state == "draining" and time.monotonic() < deadline:
            time.sleep(0.5)
            info = client.worker(name)
    console.print(f"worker {name}: {info.state}")
    if wait > 0 and info.state != "drained":
        raise KVStoreError("unavailable", f"worker {name} still {info.state} after {wait:g}s "
                           "(pinned blocks wait for their readers or their lease TTL)")


@workers_app.command()
@one_line_errors
def undrain(name: Annotated[str, typer.Argument(help="worker name")], url: Url = DEFAULT_URL, token: Token = None,
            ca_file: CaFile = None) -> None:
    """Reverse a drain that has not finished: the worker takes placements again."""
    console.print(f"worker {name}: {directory(url, token, ca_file).undrain(name).state}")


@app.command()
@one_line_errors
def evict(tier: Annotated[str, typer.Option(help="hbm, dram, nvme or s3")],
          worker: Annotated[str | None, typer.Option(help="only this worker")] = None,
          bytes_: Annotated[str | None, typer.Option("--bytes", help="move at least this much, e.g. 1GiB")] = None,
          namespace: Annotated[str | None, typer.Option(help="every block of this namespace id")] = None,
          all_: Annotated[bool, typer.Option("--all", help="every block of the tier")] = False,
          dry_run: Annotated[bool, typer.Option(help="only say what would move")] = False,
          yes: Annotated[bool, typer.Option("--yes", help="delete at the bottom tier without asking")] = False,
          url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None) -> None:
    """Move the least recently used blocks of a tier one tier down (delete them at the bottom)."""
    if tier not in ("hbm", "dram", "nvme", "s3"):
        raise KVStoreError("invalid", f"--tier must be hbm, dram, nvme or s3, not {tier!r}")
    if sum(x is not None and x is not False for x in (bytes_, namespace, all_ or None)) != 1:
        raise KVStoreError("invalid", "say what to evict with exactly one of --bytes, --namespace or --all")
    limit_bytes = parse_size(bytes_) if bytes_ else None
    client = directory(url, token, ca_file, timeout_s=600)
    ask = dict(tier=tier, worker=worker, namespace_id=namespace, bytes=limit_bytes)
    plan = client.evict_tier(specs.EvictRequest(**ask, dry_run=True))
    if dry_run or plan.replicas == 0:
        print(f"would move {plan.replicas} blocks ({format_size(plan.bytes)}) out of {tier}"
              + (f", deleting {plan.dropped} (no tier below)" if plan.dropped else "") if plan.replicas
              else f"nothing to evict from {tier}")
        return
    if plan.dropped and not yes:
        question = f"{tier} is the bottom tier: delete {plan.dropped} blocks ({format_size(plan.bytes)}) for good?"
        if not sys.stdin.isatty():
            raise KVStoreError("invalid", f"{question} Add --yes to do it without a prompt")
        if not typer.confirm(question):
            print("nothing evicted")
            return
    done = specs.Evicted(replicas=0)
    with Progress(TextColumn("evicting from " + tier), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task("evict", total=plan.replicas)
        while done.replicas < plan.replicas:
            left = None if limit_bytes is None else limit_bytes - done.bytes
            if left is not None and left <= 0:
                break
            step = client.evict_tier(specs.EvictRequest(**{**ask, "bytes": left}, limit=64))
            if step.replicas == 0:
                break  # what is left is pinned or has no room below
            done = specs.Evicted(**{k: getattr(done, k) + getattr(step, k) for k in specs.Evicted.model_fields})
            progress.update(task, completed=min(done.replicas, plan.replicas))
    print(f"{tier}: {done.demoted} blocks moved one tier down, {done.dropped} dropped, "
          f"{format_size(done.bytes)} freed")


@app.command("write-through")
@one_line_errors
def write_through(namespace_id: str, off: Annotated[bool, typer.Option("--off", help="stop copying")] = False,
                  url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None) -> None:
    """Keep a copy of every block of a namespace in S3 (needs workers with an S3 tier)."""
    policy = directory(url, token, ca_file).set_policy(namespace_id, specs.NamespacePolicy(write_through=not off))
    print(f"{namespace_id}: write-through {'on' if policy.write_through else 'off'}")


@app.command()
@one_line_errors
def lookup(namespace_id: str, token_ids: Annotated[str, typer.Argument(help="comma-separated token ids")],
           url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None) -> None:
    """How many leading tokens of a prompt the store holds."""
    try:
        tokens = [int(t) for t in token_ids.split(",") if t.strip()]
    except ValueError:
        raise KVStoreError("invalid", "token ids must be comma-separated integers") from None
    result = directory(url, token, ca_file).lookup_tokens(namespace_id, tokens)
    print(json.dumps(result.model_dump()))


@app.command()
@one_line_errors
def stats(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None) -> None:
    """Blocks, reservations, leases and pins."""
    print(json.dumps(directory(url, token, ca_file).stats().model_dump(), indent=2))


@db_app.command("upgrade")
@one_line_errors
def db_upgrade(database_url: Annotated[str, typer.Option(envvar="KVSTORE_DATABASE_URL")]
               = "sqlite:///var/directory.db") -> None:
    """Run the alembic migrations up to the newest revision."""
    from kvstore.directory import db

    db.upgrade(database_url)
    print("schema is at head")


def main() -> None:
    # operator commands print what they did; only problems are logged (servers raise this to INFO)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
