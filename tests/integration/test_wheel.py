"""The wheel as a user gets it: built from the tree, installed into fresh venvs outside it.

A directory host installs `kvstore[directory]` (no torch, no NIXL) and serves; a host with every
extra runs `kvstore up` and saves and loads a prefix through the installed package."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import kvstore
from tests.helpers import REPO, free_port, stop, wait_http, wait_until

LOAD_SCRIPT = textwrap.dedent("""
    import sys, torch
    import kvstore
    from kvstore.connector import KVStoreClient, Namespace
    assert "site-packages" in kvstore.__file__, kvstore.__file__
    ns = Namespace(model_id="wheel", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=16)
    kv = [(torch.randn(2, 64, 16), torch.randn(2, 64, 16)) for _ in range(2)]
    with KVStoreClient(sys.argv[1], ns, staging_bytes=1 << 20) as client:
        assert client.save(list(range(64)), kv) == 64
        loaded, n = client.load(list(range(64)))
    assert n == 64 and all(torch.equal(a, b) for pair, got in zip(kv, loaded) for a, b in zip(pair, got))
    print("saved and loaded 64 tokens through", kvstore.__file__)
""")


ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _run(*cmd, cwd: Path, timeout: float = 900) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _serve(tmp_path: Path, log: str, *cmd) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, env=ENV, stdout=open(tmp_path / log, "wb"),
                            stderr=subprocess.STDOUT)


def test_the_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    source = tmp_path / "src"  # the files a checkout has, built where the build leaves the tree alone
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    for name in listed:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp_path / "dist", source, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("kvstore-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvstore/directory/db/migrations/env.py" in names
    assert {f"kvstore/directory/db/migrations/versions/{p.name}" for p in
            (REPO / "kvstore/directory/db/migrations/versions").glob("*.py")} <= set(names)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python, cli = venv / "bin/python", venv / "bin/kvstore"
    _run(python, "-m", "pip", "install", "--quiet", f"{wheel}[directory]", cwd=tmp_path)
    version = _run(cli, "--version", cwd=tmp_path).strip()
    assert version == f"kvstore {kvstore.__version__}"
    print(f"\nwheel: {wheel.name} ({wheel.stat().st_size} bytes, {len(names)} files); "
          f"directory-only venv: `kvstore --version` -> {version}")
    missing = subprocess.run([python, "-c", "import torch"], capture_output=True, cwd=tmp_path)
    assert missing.returncode != 0, "a directory-only install pulled torch"
    assert subprocess.run([python, "-c", "import nixl_cu12"], capture_output=True, cwd=tmp_path).returncode != 0
    print("directory-only venv: import torch fails, import nixl_cu12 fails")

    port = free_port()
    directory = _serve(tmp_path, "directory.log", cli, "directory", "serve", "--insecure-no-auth", "--port", port,
                       "--data-dir", tmp_path / "dir-only")
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", proc=directory)  # migrations ran from the wheel
        print("directory-only venv: `kvstore directory serve` migrated its database and is ready")
    finally:
        stop(directory)

    _run(python, "-m", "pip", "install", "--quiet", "torch==2.13.0", cwd=tmp_path)
    _run(python, "-m", "pip", "install", "--quiet", f"{wheel}[all]", cwd=tmp_path)
    port = free_port()
    up = _serve(tmp_path, "up.log", cli, "up", "--port", port, "--data-dir", tmp_path / "var", "--dram-bytes",
                "16MiB", "--nvme-bytes", "0")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz", proc=up)
        wait_until(lambda: '"active"' in _run(cli, "workers", "--url", url, "--output", "json", cwd=tmp_path), 60,
                   "the worker registered")
        (tmp_path / "load.py").write_text(LOAD_SCRIPT)
        loaded = _run(python, tmp_path / "load.py", url, cwd=tmp_path)
        assert "saved and loaded 64 tokens" in loaded
        print(f"venv with every extra, `kvstore up`: {loaded.strip()}")
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0, (tmp_path / "up.log").read_text()[-3000:]
