"""`kvstore tokens create|list|revoke`: scoped bearer tokens (needs an admin token)."""

from __future__ import annotations

import datetime
import json
from typing import Annotated

import typer
from rich.table import Table

from kvstore.cli.common import DEFAULT_URL, CaFile, Output, Token, Url, console, directory, emit, one_line_errors
from kvstore.core.credentials import SCOPES, TokenCreate
from kvstore.core.errors import KVStoreError

tokens_app = typer.Typer(help="Scoped bearer tokens: create, list, revoke.", no_args_is_help=True)


@tokens_app.command()
@one_line_errors
def create(scope: Annotated[list[str], typer.Option(help="engine, worker, read or admin; repeat for several")],
           tenant: Annotated[list[str] | None, typer.Option(help="an engine token's tenant; repeat for several")]
           = None,
           name: Annotated[str, typer.Option(help="what the token is for")] = "",
           url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Create a token and print it on the last line (it is shown only this once)."""
    unknown = sorted(set(scope) - set(SCOPES))
    if unknown:
        raise KVStoreError("invalid", f"unknown scope {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    body = TokenCreate(name=name or "+".join(scope), scopes=scope, tenants=tenant or [])
    created = directory(url, token, ca_file).create_token(body)
    if output == "json":
        emit(output, created)
        return
    info = created.info
    console.print(f"token {info.id} ({info.name}): scopes {', '.join(info.scopes)}"
                  + (f", tenants {', '.join(info.tenants)}" if info.tenants else ""), highlight=False)
    print(created.token)


@tokens_app.command("list")
@one_line_errors
def list_(url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Every token, revoked ones included (never their secrets)."""
    rows = directory(url, token, ca_file).tokens()
    if output == "json":
        print(json.dumps([r.model_dump() for r in rows], indent=2))
        return
    table = Table("id", "name", "scopes", "tenants", "created", "revoked")
    for r in rows:
        table.add_row(r.id, r.name, ",".join(r.scopes), ",".join(r.tenants), _when(r.created_at),
                      _when(r.revoked_at) if r.revoked_at else "")
    console.print(table)


@tokens_app.command()
@one_line_errors
def revoke(token_id: Annotated[str, typer.Argument(help="the id `tokens list` shows")],
           url: Url = DEFAULT_URL, token: Token = None, ca_file: CaFile = None, output: Output = "table") -> None:
    """Revoke a token: the directory refuses it from now on."""
    info = directory(url, token, ca_file).revoke_token(token_id)
    emit(output, info, text=f"token {info.id} ({info.name}) revoked")


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
