"""What every operator command shares: the directory's address and credentials, one-line errors."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from enum import Enum
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from kvstore.client import DirectoryClient
from kvstore.core.errors import KVStoreError, Unreachable

Url = Annotated[str, typer.Option(envvar="KVSTORE_URL", help="directory URL; several, comma-separated, are "
                                  "tried in turn")]
Token = Annotated[str | None, typer.Option(envvar="KVSTORE_TOKEN", show_envvar=True,
                                           help="bearer token (admin, or read for listings)")]
CaFile = Annotated[str | None, typer.Option(envvar="KVSTORE_CA_FILE", help="CA bundle for an https directory")]


class Format(str, Enum):
    table = "table"
    json = "json"


Output = Annotated[Format, typer.Option("--output", "-o", help="table or json", case_sensitive=False)]
# exit codes: 0 done; 1 the directory refused the call (bad input, a credential, a conflict); 2 bad
# usage (typer's); 3 the directory could not be reached; 4 it answered with a server error
EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_SERVER = 1, 3, 4
DEFAULT_URL = "http://127.0.0.1:8700"
console = Console(markup=False)  # names, tenants and messages come from users: never markup


def emit(output: Format, data, table: Callable[[], object] | None = None, text: str | None = None) -> None:
    """`data` as JSON with --output json; else the table `table()` builds, or the line `text`."""
    if output == Format.json:
        print(json.dumps(_plain(data), indent=2))
    elif table is not None:
        console.print(table())
    else:
        console.print(text, highlight=False, soft_wrap=True)


def _plain(data):
    if hasattr(data, "model_dump"):
        return data.model_dump(mode="json")
    if isinstance(data, list):
        return [_plain(x) for x in data]
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    return data


def ago(t: float | None, now: float | None = None) -> str:
    """How long ago `t` (Unix time) was, for a table: 4.2 s, 3 min, 5 h, 2 d."""
    if t is None:
        return "-"
    s = max(0.0, (time.time() if now is None else now) - t)
    if s < 60:
        return f"{s:.1f} s ago"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def directory(url: str, token: str | None, ca_file: str | None, timeout_s: float = 30.0) -> DirectoryClient:
    return DirectoryClient(url, timeout_s=timeout_s, token=token, ca_file=ca_file)


def exit_code(exc: KVStoreError) -> int:
    if isinstance(exc, Unreachable):
        return EXIT_UNREACHABLE
    return EXIT_SERVER if exc.http_status >= 500 else EXIT_REFUSED


def one_line_errors(command):
    """A command whose errors, the directory's and its own input's, are one line and an exit code
    that says whose they are (`exit_code`)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KVStoreError as exc:
            _fail(str(exc), exit_code(exc))
        except ValidationError as exc:  # a request the command built from bad arguments
            _fail(problems(exc, "input", limit=5), EXIT_REFUSED)
    return wrapper


def problems(exc: ValidationError, whole: str, limit: int | None = None) -> str:
    """A validation error's problems on one line: `field: message; ...` (`whole` names a problem
    of the whole object)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors()[:limit])


def _fail(message: str, code: int):
    # as text, never markup: a message may hold brackets
    Console(stderr=True, soft_wrap=True).print(Text("error: ", style="red") + Text(message), highlight=False)
    raise typer.Exit(code) from None
