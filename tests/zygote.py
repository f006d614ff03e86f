"""Engine processes without paying for their imports each time: a zygote process imports the
engines' modules (torch, transformers, vLLM: 4-6 s) once, then forks a child per engine run. Each
child starts from the same freshly imported state, with nothing of an earlier run in it (no NIXL
agent, no model, no registry samples), as a new interpreter would.

    python -m tests.zygote MODULE [MODULE ...]   # imports them, then one JSON request per line:
    {"op": "spawn", "module": M, "args": [...], "log": PATH}  -> {"pid": N}   # M.main() with argv
    {"op": "wait", "pid": N, "timeout": S}                    -> {"returncode": RC, or null}

    zygote = Zygote(["tests.integration.engine"]); proc = zygote.spawn(module, argv, log)
    proc.wait(timeout) / proc.poll() / proc.send_signal(sig) / proc.kill()   # as with a Popen
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- the zygote ---------------------------------------------------------------------------------

def _spawn(module: str, args: list[str], log: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: `python -m MODULE ARGS`, its output in `log`
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the zygote's requests
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        sys.stdin = open(0, closefd=False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.argv = [module, *args]
        importlib.import_module(module).main()
        os._exit(0)
    except SystemExit as exc:
        os._exit(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:
        traceback.print_exc()
    os._exit(1)


def _wait(pid: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def main() -> None:
    for module in sys.argv[1:]:
        importlib.import_module(module)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            answer = {"pid": _spawn(request["module"], request["args"], request["log"])}
        else:
            answer = {"returncode": _wait(request["pid"], request.get("timeout", 0.0))}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


# ---- the tests' side ----------------------------------------------------------------------------

class Forked:
    """An engine forked by the zygote: what the tests use of a Popen."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.ask({"op": "wait", "pid": self.pid, "timeout": 0.0})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.returncode is None:
            self.returncode = self._zygote.ask({"op": "wait", "pid": self.pid, "timeout": 0.5})["returncode"]
            if self.returncode is None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, modules: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", *modules], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, "the engine zygote died"
        return json.loads(line)

    def spawn(self, module: str, argv: list[str], log: Path) -> Forked:
        return Forked(self, self.ask({"op": "spawn", "module": module, "args": argv, "log": str(log)})["pid"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    main()
