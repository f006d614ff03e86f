"""Two minutes of `bench/soak.py`: three directory replicas on PostgreSQL, three workers with NVMe
and S3, two engines, and faults injected at random (workers, the leader and a follower killed or
stopped, PostgreSQL restarted, database connections cut, S3 down or slow, an NVMe disk full).
Nothing is lost, every fault is recovered from, and the cluster settles with every replica's index
agreeing and each worker's page accounting equal to the directory's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.postgres


def test_two_minutes_of_faults_lose_nothing_and_every_fault_is_recovered_from(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "bench/soak.py", "--minutes", "2", "--json", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    context = json.dumps(report, indent=1) + run.stdout[-2000:]
    assert report["lost"] == 0 and report["loads"]["wrong"] == 0 and report["engine_errors"] == 0, context
    assert sum(k["injected"] for k in report["faults"].values()) >= 3, context
    assert report["all_recovered"] and report["settled"] and report["replicas_agree"] and report["pages_agree"], context
    assert report["loads"]["exact"] > 0, context
    assert run.returncode == 0, context
