"""The images and the Compose stack, built and run where a Docker daemon answers: both Dockerfile
targets build, and `deploy/compose.yaml` comes up with a ready directory and two active workers.
Where no daemon answers (the machine this was written on, and CI's), the test says so and skips:
the files' structure is checked by tests/unit/test_deploy.py either way."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest

from tests.helpers import REPO, wait_until

COMPOSE = ["docker", "compose", "-f", str(REPO / "deploy/compose.yaml"), "-p", "kvstore-test"]


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not docker_answers(), reason="no Docker daemon answers on this machine: the images and the "
                    "compose stack were not built or run here")
def test_the_images_build_and_the_compose_stack_serves():
    for target, tag in (("full", "kvstore:cpu"), ("directory", "kvstore-directory:cpu")):
        built = subprocess.run(["docker", "build", "--target", target, "-t", tag, str(REPO)], capture_output=True,
                               text=True, timeout=3600)
        assert built.returncode == 0, built.stderr[-3000:]
    try:
        up = subprocess.run([*COMPOSE, "up", "-d", "--wait"], capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stderr[-3000:]

        def ready() -> bool:
            try:
                with urllib.request.urlopen("http://127.0.0.1:8700/readyz?workers=2", timeout=5) as answer:
                    return answer.status == 200
            except OSError:  # refused, or 503 while it starts
                return False
        wait_until(ready, 300, "the directory ready with two workers")
        services = subprocess.run([*COMPOSE, "ps", "--format", "json"], capture_output=True, text=True, timeout=60)
        rows = [json.loads(line) for line in services.stdout.splitlines() if line.strip()]
        health = {r["Service"]: r.get("Health", "") for r in rows}
        assert all(health.get(s) == "healthy" for s in ("directory", "worker1", "worker2")), health
    finally:
        subprocess.run([*COMPOSE, "down", "-v"], capture_output=True, timeout=300)
