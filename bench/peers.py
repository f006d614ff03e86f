"""Plumbing of the comparisons with other stores: each side runs in its own process (the peers
live in their own venvs), writes its result as JSON and leaves without interpreter teardown.
Standard library only: the peers' venvs import this too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_python(venv: str, make_target: str) -> str:
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"error: {venv} is missing; run `make {make_target}` first")
    return str(python)


def run_side(python: str, script: str, side: str, argv: list[str], tmp: str, env: dict[str, str] | None = None) -> dict:
    """`python script --side SIDE --out F --tmp TMP argv...` and the JSON it wrote to F."""
    out = Path(tmp) / f"{side}-{len(os.listdir(tmp))}.json"
    cmd = [python, script, "--side", side, "--out", str(out), "--tmp", tmp, *argv]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {side} side failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def finish_side(result: dict, out: str) -> None:
    Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: NIXL's UCX threads can crash it
