"""What every operator command shares: the directory's address and credentials, one-line errors."""

from __future__ import annotations

import functools
from enum import Enum
from typing import Annotated

import typer
from rich.console import Console

from kvstore.client import DirectoryClient
from kvstore.core.errors import KVStoreError

Url = Annotated[str, typer.Option(envvar="KVSTORE_URL", help="directory URL")]
Token = Annotated[str | None, typer.Option(envvar="KVSTORE_TOKEN", show_envvar=True,
                                           help="bearer token (admin, or read for listings)")]
CaFile = Annotated[str | None, typer.Option(envvar="KVSTORE_CA_FILE", help="CA bundle for an https directory")]
class Format(str, Enum):
    table = "table"
    json = "json"


Output = Annotated[Format, typer.Option(help="table or json", case_sensitive=False)]
DEFAULT_URL = "http://127.0.0.1:8700"
console = Console()


def directory(url: str, token: str | None, ca_file: str | None, timeout_s: float = 30.0) -> DirectoryClient:
    return DirectoryClient(url, timeout_s=timeout_s, token=token, ca_file=ca_file)


def one_line_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KVStoreError as exc:
            Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(1) from None
    return wrapper
