"""Test plumbing: free ports, waiting for HTTP, child processes, a throw-away PostgreSQL."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout_s}s")


def kvstore_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli.main", *args]


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **env} if env else None)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerThread:
    """A uvicorn server for an ASGI app on a free loopback port, in a thread of this process."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        wait_http(self.url + "/readyz?workers=0")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _stat(proc: Path) -> list[str]:
    """State, parent pid, ... of a process (nothing once it is gone)."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent(proc: Path) -> int | None:
    fields = _stat(proc)
    return int(fields[1]) if fields else None


def _running(pid: int) -> bool:
    fields = _stat(Path(f"/proc/{pid}"))
    return bool(fields) and fields[0] != "Z"


class PostgresCluster:
    """A throw-away PostgreSQL cluster on 127.0.0.1 and a free port (run as `postgres` when root)."""

    def __init__(self, settings: str = "") -> None:
        """`settings`: more server options (`-c name=value ...`)."""
        self.settings = settings
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb") or ""]
        if not found[-1]:
            raise RuntimeError("PostgreSQL server binaries not found; `make setup` installs them")
        self.bindir = Path(found[-1]).parent
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-pg-"))
        self.data = self.root / "data"
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def start(self) -> "PostgresCluster":
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self._options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off {self.settings}"
        self._start()
        return self

    def _start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.root / "log"), "-w", "start")

    def crash(self) -> None:
        """SIGKILL the server and every process of it, then start it again on the same port: WAL
        it had not written yet is lost, as in a crash (what the OS was given survives)."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]
        for victim in (pid, *children):  # the postmaster first: it would restart its children
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not any(_running(p) for p in (pid, *children)), 10, "postgres gone")
        for lock in (self.data / "postmaster.pid", self.root / f".s.PGSQL.{self.port}.lock"):  # a zombie
            lock.unlink(missing_ok=True)  # postmaster still "exists" to the new one's check
        self._start()

    def stop_and_start(self, down_s: float) -> None:
        """`pg_ctl -m immediate stop` (every session cut, no shutdown checkpoint: recovery at the next
        start), `down_s` seconds away, then started again on the same port."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        time.sleep(down_s)
        self._start()

    def restart(self) -> None:
        """Stop (fast: every session ends) and start again on the same port."""
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.root / "log"), "-w",
                  "-m", "fast", "restart")

    def create_database(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class MotoServer:
    """A real S3 HTTP endpoint (moto_server) on a free loopback port, with test credentials."""

    CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1"}

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MotoServer":
        exe = Path(sys.executable).parent / "moto_server"
        self.proc = spawn([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], self._log_path)
        wait_http(self.url + "/moto-api/", proc=self.proc)
        return self

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


class Proxy:
    """A TCP forwarder on loopback: what a network between two services does, cut and restored on
    demand (`cut()` closes the listener and every open connection; `restore()` listens again), or
    slowed (`delay_s`: each chunk forwarded waits this long)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() a bare close() leaves listening
        except OSError:
            pass
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the other side is down: so is this connection
                client.close()
                continue
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def raw_request(server, head: str, body: bytes = b"", timeout_s: float = 10) -> tuple[int, dict]:
    """One HTTP/1.1 request written byte by byte to `server` (.host, .port): (status, JSON body)."""
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def interrupt(proc) -> int:
    """Ctrl-C a process (SIGINT) and wait for its exit status."""
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=30)
