"""Traces with sessions and hints through the policy bench: synth_trace writes them, hit_ratio gives
them to the policies only with --hints, side by side with the run without them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_hinted_and_unhinted_runs_side_by_side(tmp_path):
    trace, out = tmp_path / "chat.jsonl", tmp_path / "hr.json"
    made = bench("bench/synth_trace.py", "--kind", "chat", "--requests", "4000", "--out", str(trace))
    assert made.returncode == 0, made.stderr
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["session_id"].startswith("chat-") and first["turn"] == 0 and first["retain"] in ("turn", "session",
                                                                                                  "none")
    ran = bench("bench/hit_ratio.py", "--trace", str(trace), "--capacities", "0.05", "--policies", "default,lru",
                "--hints", "--random-hints", "--json", str(out))
    assert ran.returncode == 0, ran.stderr
    rows = {(r["policy"], r["hints"], r.get("random", False)): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(p, h, r) for p in ("default", "lru") for h, r in ((False, False), (True, False),
                                                                           (True, True))} | {("opt", False, False)}
    assert all({"capacity_fraction", "policy", "prefix_hit_ratio", "block_hit_ratio", "hints"} <= set(r)
               for r in rows.values())
    lru = [rows[("lru", h, r)]["prefix_hit_ratio"] for h, r in ((False, False), (True, False), (True, True))]
    assert lru[0] == lru[1] == lru[2]  # LRU ignores hints
    assert rows[("default", True, False)]["prefix_hit_ratio"] > rows[("default", False, False)]["prefix_hit_ratio"]

    plain = bench("bench/hit_ratio.py", "--trace", str(trace), "--capacities", "0.05", "--policies", "lru",
                  "--json", str(out))
    assert plain.returncode == 0 and {r["hints"] for r in json.loads(out.read_text())["results"]} == {False}


def test_a_trace_with_a_bad_hint_is_refused_with_its_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 3], "retain": "forever"}\n')
    ran = bench("bench/hit_ratio.py", "--trace", str(trace), "--policies", "lru", "--json", str(tmp_path / "o.json"))
    assert ran.returncode != 0 and "line 2: retain 'forever'" in ran.stderr and "Traceback" not in ran.stderr
