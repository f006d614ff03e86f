"""Credentials and TLS with real processes: `directory serve` and `worker serve` over HTTPS with a
throw-away CA, tokens from the CLI, and `kvstore up --require-auth`."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvstore.client import DirectoryClient
from kvstore.client.worker import WorkerControlClient
from kvstore.connector import KVStoreClient, Namespace
from kvstore.core import page_calls
from kvstore.core.errors import KVStoreError
from tests.helpers import free_port, kvstore_cmd, spawn, stop, wait_http, wait_until

NS = Namespace(model_id="tls-test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=16,
               tenant="acme")


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(directory: Path) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 it signed: (ca.pem, server.pem, server.key)."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore test CA")])
    ca = _cert("kvstore test CA", ca_key, ca_name, ca_key, ca=True)
    server = _cert("127.0.0.1", key, ca_name, ca_key, ca=False)
    paths = [directory / "ca.pem", directory / "server.pem", directory / "server.key"]
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tuple(str(p) for p in paths)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(kvstore_cmd(*args), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def test_tls_tokens_and_tenants_end_to_end(tmp_path):
    ca, cert, key = make_ca(tmp_path)
    port, data = free_port(), tmp_path / "var"
    url = f"https://127.0.0.1:{port}"
    directory = spawn(kvstore_cmd("directory", "serve", "--port", str(port), "--data-dir", str(data),
                                  "--tls-cert", cert, "--tls-key", key, "--ca-file", ca, "--verify-writes",
                                  "--admin-token-file", str(data / "admin.token"),
                                  "--worker-token-file", str(data / "worker.token")), tmp_path / "directory.log")
    worker = None
    try:
        admin_file = data / "admin.token"
        wait_until(lambda: directory.poll() is None and _ready(url, ca), 60, "directory over https")
        assert stat.S_IMODE(os.stat(admin_file).st_mode) == 0o600
        admin = admin_file.read_text().strip()
        worker = spawn(kvstore_cmd("worker", "serve", "--directory-url", url, "--name", "w0", "--dram-bytes", "16MiB",
                                   "--page-bytes", "16KiB", "--ca-file", ca, "--tls-cert", cert, "--tls-key", key),
                       tmp_path / "worker.log", env={"KVSTORE_TOKEN": (data / "worker.token").read_text().strip()})
        operator = DirectoryClient(url, token=admin, ca_file=ca)
        wait_until(lambda: [w.state for w in operator.workers()] == ["active"], 60, "worker registered")
        control_url = operator.workers()[0].control_url
        assert control_url.startswith("https://")

        made = cli("tokens", "create", "--scope", "engine", "--tenant", "acme", "--name", "engine-acme",
                   "--url", url, "--ca-file", ca, env={"KVSTORE_TOKEN": admin})
        assert made.returncode == 0, made.stderr
        engine = made.stdout.strip().splitlines()[-1]
        assert engine.startswith("kvs_")
        listed = json.loads(cli("tokens", "list", "--output", "json", "--url", url, "--ca-file", ca,
                                "--token", admin).stdout)
        assert {"bootstrap admin", "bootstrap worker", "engine-acme"} <= {t["name"] for t in listed}

        kv = [(torch.randn(2, 64, 16), torch.randn(2, 64, 16)) for _ in range(2)]
        with KVStoreClient(url, NS, staging_bytes=1 << 20, token=engine, ca_file=ca) as client:
            assert client.save(list(range(64)), kv) == 64  # four blocks, each verified by the worker
            loaded, n = client.load(list(range(64)))
            assert n == 64 and all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv, loaded) for a, b in
                                   ((ka, kb), (va, vb)))
        # pushed by the worker over its HTTPS control port, under a grant bound to this engine's token
        with KVStoreClient(url, NS, staging_bytes=1 << 20, token=engine, ca_file=ca, same_host="off",
                           load_push="on") as pushed:
            loaded, n = pushed.load(list(range(64)))
            assert n == 64 and all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv, loaded) for a, b in
                                   ((ka, kb), (va, vb)))
            assert (pushed.pusher.pushed, pushed.pusher.failed) == (4, 0)

        with pytest.raises(KVStoreError) as untrusted:  # no CA: the certificate cannot be checked
            DirectoryClient(url, token=admin).stats()
        assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value)
        with pytest.raises(KVStoreError) as anonymous:
            DirectoryClient(url, ca_file=ca, token="kvs_nobody").stats()
        assert anonymous.value.kind == "unauthorized"
        with pytest.raises(KVStoreError) as other_tenant:  # an engine of acme cannot register for globex
            DirectoryClient(url, token=engine, ca_file=ca).register_namespace(Namespace(
                model_id="x", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4,
                tenant="globex"))
        assert other_tenant.value.kind == "forbidden"
        with pytest.raises(KVStoreError) as forged:  # the worker serves only the directory
            WorkerControlClient(control_url, ca_file=ca, token=admin).allocate(
                page_calls.AllocRequest(token="mine", kind="dram", sizes=[16384]))
        assert forged.value.kind == "unauthorized"
        assert operator.stats().blocks == 4
    finally:
        for proc in (worker, directory):
            if proc is not None:
                stop(proc)


def _ready(url: str, ca: str) -> bool:
    try:
        return DirectoryClient(url, ca_file=ca).call_raw("GET", "/readyz?workers=0")["status"] == "ready"
    except KVStoreError:
        return False


def test_up_requires_credentials_when_asked_and_says_so_when_it_does_not(tmp_path):
    port, data = free_port(), tmp_path / "var"
    url = f"http://127.0.0.1:{port}"
    up = spawn(kvstore_cmd("up", "--port", str(port), "--data-dir", str(data), "--dram-bytes", "16MiB",
                           "--nvme-bytes", "0", "--require-auth"), tmp_path / "up.log")
    try:
        wait_http(url + "/readyz", proc=up)
        admin = (data / "admin.token").read_text().strip()
        assert stat.S_IMODE(os.stat(data / "admin.token").st_mode) == 0o600
        refused = cli("tiers", "--url", url, env={"KVSTORE_TOKEN": ""})
        assert refused.returncode == 1 and "unauthorized" in refused.stderr
        wait_until(lambda: json.loads(cli("workers", "--url", url, "--output", "json", "--token", admin).stdout
                                      or "[]"), 60, "the embedded worker registered with its token")
        assert "credentials required" in (tmp_path / "up.log").read_text()
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    port = free_port()
    up = spawn(kvstore_cmd("up", "--port", str(port), "--data-dir", str(tmp_path / "open"), "--dram-bytes", "16MiB",
                           "--nvme-bytes", "0"), tmp_path / "open.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc=up)
        assert cli("tiers", "--url", f"http://127.0.0.1:{port}").returncode == 0
        wait_until(lambda: "credentials are off" in (tmp_path / "open.log").read_text(), 30, "the log says so")
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
