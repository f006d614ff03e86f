"""Hosts of their own for tests: Linux network namespaces joined by a bridge, each with its own
address (198.18.0.0/24, the range set aside for benchmarking networks) and its own arena folder,
so that no same-host mapping crosses them and UCX speaks TCP between them.

    with Hosts(tmp, ["dir", "w1", "e1"]) as hosts:      # skips the test where namespaces are refused
        hosts.addr("dir")                               # "198.18.0.1"; this process reaches each host
        proc = hosts.spawn("dir", [...], log, env)      # a process on that host, stopped on exit
        hosts.shape("e1", "1gbit")                      # the link to that host at a stated rate (tbf)
        hosts.bytes_to("e1")                            # bytes sent towards it so far
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import spawn, stop

NET = "198.18.0"
HERE = f"{NET}.254"  # the bridge's own address: this process's way to the hosts


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    def __init__(self, tmp: Path, names: list[str]) -> None:
        tag = str(os.getpid() % 100_000)
        self.tmp, self.bridge = tmp, f"kvb{tag}"
        self._ns = {name: f"kv{tag}{name}" for name in names}
        self._addr = {name: f"{NET}.{i + 1}" for i, name in enumerate(names)}
        self._veth = {name: f"kv{tag}v{i}" for i, name in enumerate(names)}  # the bridge's end of each link
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            pytest.skip(f"network namespaces cannot be made here (they need root and iproute2): "
                        f"{getattr(exc, 'stderr', '') or exc}")
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{HERE}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, ns in self._ns.items():
            _ip("netns", "add", ns)
            outside, inside = self._veth[name], self._veth[name] + "p"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def addr(self, host: str) -> str:
        return self._addr[host]

    def folder(self, host: str) -> Path:
        """The host's own folder (its arena sockets, its data)."""
        path = self.tmp / f"host-{host}"
        path.mkdir(exist_ok=True)
        return path

    def spawn(self, host: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`argv` on `host`, with the host's own arena folder; stopped when the hosts go."""
        env = {"KVSTORE_ARENA_DIR": str(self.folder(host) / "arenas"), **(env or {})}
        proc = spawn(["ip", "netns", "exec", self._ns[host], *argv], log, env)
        self._procs.append(proc)
        return proc

    def shape(self, host: str, rate: str) -> None:
        """Traffic towards `host` at most `rate` (tc's token bucket on the bridge's end of its link)."""
        subprocess.run(["tc", "qdisc", "replace", "dev", self._veth[host], "root", "tbf", "rate", rate,
                        "burst", "1mb", "latency", "50ms"], check=True, capture_output=True, timeout=30)

    def bytes_to(self, host: str) -> int:
        """Bytes sent towards `host` over its link so far."""
        return int(Path(f"/sys/class/net/{self._veth[host]}/statistics/tx_bytes").read_text())

    def close(self) -> None:
        for proc in self._procs:
            stop(proc)
        for ns in self._ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for veth in self._veth.values():
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
