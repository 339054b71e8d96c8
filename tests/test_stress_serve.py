"""`python -m benchmarks.stress_serve --short`: the load / fuzz / fault suite at test-suite size.

It starts real servers (embedded default model) and reports what it saw; this test asserts the
properties that must hold whatever the machine's speed: nothing hangs, no malformed request gets a 5xx,
every page comes back, aborted streams leak nothing, a kill -9 restart serves on the same port, and
schemathesis finds no server error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_stress_serve_short(tmp_path):
    out = tmp_path / "stress.json"
    cmd = [sys.executable, "-m", "benchmarks.stress_serve", "--short", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    a, b, c, d, e = r["load"], r["malformed"], r["aborts"], r["restart"], r["schemathesis"]
    assert a["hung"] == 0 and a["5xx"] == 0, a
    assert a["completed"] + a["explicit_errors"] == a["requests"] and a["completed"] > 0, a
    assert a["pages_in_use_after"] == 0, a
    assert b["requests"] >= 200 and b["5xx"] == 0 and b["other"] == 0, b
    assert b["by_status"].get("413") == 1 and b["errors_without_message"] == 0, b
    assert b["pages_in_use_after"] == 0, b
    assert c["cut_mid_way"] == c["streams"] and c["pages_in_use_after"] == 0, c
    assert d["same_port"] and d["serves_after"], d
    assert e["ran"] and e["exit_code"] == 0 and e["server_5xx"] == 0, e
