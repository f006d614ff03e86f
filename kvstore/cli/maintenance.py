"""`kvstore evict`, `kvstore flush`, `kvstore write-through` and `kvstore replicas`: what operators change
in the store."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, directory, emit, one_line_errors
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size, parse_size

Yes = Annotated[bool, typer.Option("--yes", help="do it without asking")]
EVICT_PLAN_LIMIT = 100_000  # blocks one dry run counts (the directory's bound on one request)


def _confirm(question: str, yes: bool) -> bool:
    """True to go on: --yes, or a yes at the prompt; without a terminal, refused with what to add."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise KVStoreError("invalid", f"{question} Add --yes to do it without a prompt")
    return typer.confirm(question, err=True)  # stdout carries only the answer (--output json)


@one_line_errors
def evict(tier: Annotated[str, typer.Option(help="hbm, dram, nvme or s3")],
          worker: Annotated[str | None, typer.Option(help="only this worker")] = None,
          bytes_: Annotated[str | None, typer.Option("--bytes", help="move at least this much, e.g. 1GiB")] = None,
          namespace: Annotated[str | None, typer.Option(help="every block of this namespace id")] = None,
          all_: Annotated[bool, typer.Option("--all", help="every block of the tier")] = False,
          dry_run: Annotated[bool, typer.Option(help="only say what would move")] = False,
          yes: Annotated[bool, typer.Option("--yes", help="delete at the bottom tier without asking")] = False,
          url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Move the least recently used blocks of a tier one tier down (delete them at the bottom)."""
    if tier not in ("hbm", "dram", "nvme", "s3"):
        raise KVStoreError("invalid", f"--tier must be hbm, dram, nvme or s3, not {tier!r}")
    if sum(x is not None and x is not False for x in (bytes_, namespace, all_ or None)) != 1:
        raise KVStoreError("invalid", "say what to evict with exactly one of --bytes, --namespace or --all")
    limit_bytes = parse_size(bytes_) if bytes_ else None
    client = directory(url, token, ca_file, timeout_s=600)
    ask = dict(tier=tier, worker=worker, namespace_id=namespace, bytes=limit_bytes)
    plan = client.evict_tier(specs.EvictRequest(**ask, dry_run=True, limit=EVICT_PLAN_LIMIT))
    if dry_run or plan.replicas == 0:
        emit(output, {"dry_run": True, **plan.model_dump()},
             text=f"would move {plan.replicas} blocks ({format_size(plan.bytes)}) out of {tier}"
             + (f", deleting {plan.dropped} (no tier below)" if plan.dropped else "") if plan.replicas
             else f"nothing to evict from {tier}")
        return
    question = f"{tier} is the bottom tier: delete {plan.dropped} blocks ({format_size(plan.bytes)}) for good?"
    if plan.dropped and not _confirm(question, yes):
        emit(output, {"dry_run": False, **specs.Evicted(replicas=0).model_dump()}, text="nothing evicted")
        return
    done = specs.Evicted(replicas=0)
    with Progress(TextColumn("evicting from " + tier), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task("evict", total=plan.replicas)
        # the plan's blocks (all that is movable when the plan counted fewer than its limit), the bytes asked
        while done.replicas < plan.replicas or plan.replicas == EVICT_PLAN_LIMIT:
            left = None if limit_bytes is None else limit_bytes - done.bytes
            if left is not None and left <= 0:
                break
            step = client.evict_tier(specs.EvictRequest(**{**ask, "bytes": left}, limit=64))
            if step.replicas == 0:
                break  # what is left is pinned or has no room below
            done = specs.Evicted(**{k: getattr(done, k) + getattr(step, k) for k in specs.Evicted.model_fields})
            progress.update(task, completed=min(done.replicas, plan.replicas))
    emit(output, {"dry_run": False, **done.model_dump()},
         text=f"{tier}: {done.demoted} blocks moved one tier down, {done.dropped} dropped, "
              f"{format_size(done.bytes)} freed")


@one_line_errors
def flush(namespace: Annotated[str, typer.Option(help="the namespace id (kvstore namespaces)")],
          dry_run: Annotated[bool, typer.Option(help="only say what would be deleted")] = False, yes: Yes = False,
          url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Delete every block of a namespace from every tier, S3 included. Pinned blocks go when their
    readers release them."""
    client = directory(url, token, ca_file, timeout_s=600)
    if namespace not in {n.namespace_id for n in client.namespaces()}:
        raise KVStoreError("not_found", f"no namespace {namespace!r} (kvstore namespaces lists them)")
    plan = client.evict_tier(specs.EvictRequest(namespace_id=namespace, dry_run=True))
    what = f"{plan.replicas} replicas ({format_size(plan.bytes)}) of namespace {namespace}"
    if dry_run or plan.replicas == 0:
        emit(output, {"dry_run": True, **plan.model_dump()},
             text=f"would delete {what}" if plan.replicas else f"namespace {namespace} holds nothing")
        return
    if not _confirm(f"delete {what} from every tier, S3 included?", yes):
        emit(output, {"dry_run": False, **specs.Evicted(replicas=0).model_dump()}, text="nothing deleted")
        return
    done = client.evict_tier(specs.EvictRequest(namespace_id=namespace))
    emit(output, {"dry_run": False, **done.model_dump()},
         text=f"namespace {namespace}: {done.replicas} replicas ({format_size(done.bytes)}) deleted")


@one_line_errors
def write_through(namespace_id: str, off: Annotated[bool, typer.Option("--off", help="stop copying")] = False,
                  url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None,
                  output: Output = "table") -> None:
    """Keep a copy of every block of a namespace in S3 (needs workers with an S3 tier)."""
    policy = directory(url, token, ca_file).set_policy(namespace_id, specs.NamespacePolicy(write_through=not off))
    emit(output, {"namespace_id": namespace_id, **policy.model_dump()},
         text=f"{namespace_id}: write-through {'on' if policy.write_through else 'off'}")



@one_line_errors
def replicas(namespace_id: str,
             count: Annotated[int, typer.Argument(min=1, max=3, help="workers that hold each block (1-3)")],
             url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Keep each block of a namespace on COUNT workers (DRAM or NVMe), so that losing a worker loses no
    prefix; the directory makes the copies in the background, worker to worker."""
    policy = directory(url, token, ca_file).set_policy(namespace_id, specs.NamespacePolicy(replicas=count))
    emit(output, {"namespace_id": namespace_id, **policy.model_dump()},
         text=f"{namespace_id}: {policy.replicas} replica{'s' if policy.replicas > 1 else ''} per block")
