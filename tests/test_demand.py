"""The demand signal (issue 17): slots each tier needs, from broker depths and the fleet's reports."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from celery_prio.ops.fleet import cluster_status
from celery_prio.policy.demand import fleet_estimate, slots_needed
from celery_prio.settings import load_settings
from celery_prio.tools.workers import free_port
from tests.conftest import ROOT


@pytest.mark.parametrize(
    ("waiting", "running", "estimate", "target", "needed"),
    [
        (0, 0, None, 1.0, 0),  # nothing to do: scale to zero
        (0, 3, 0.5, 1.0, 3),  # what runs keeps its slots
        (5, 0, None, 1.0, 1),  # unknown run time: a first slot, to learn it
        (10, 1, 0.02, 0.2, 2),  # realtime: 10 x 20 ms to drain in 200 ms -> one more slot
        (100, 0, 0.02, 0.2, 10),
        (3000, 4, 2.0, 3600, 6),  # offline: 6,000 slot-seconds in an hour -> 2 more
        (1, 0, 0.0, 1.0, 1),  # waiting work always asks for a slot
    ],
)
def test_slots_needed(waiting, running, estimate, target, needed):
    assert slots_needed(waiting, running, estimate, target) == needed


def test_fleet_estimate_weighs_workers_by_what_they_finished():
    assert fleet_estimate([(0, 9.0), (3, 1.0), (1, 2.0)]) == pytest.approx(1.25)
    assert fleet_estimate([(0, 1.0)]) is None


def test_bad_demand_target_is_refused():
    from celery_prio.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prio_demand_target\[batch\] must be a number > 0, got 0"):
        load_settings({}, {"demand_target": {"batch": 0}})


def _scrape(port: int) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, sample.labels.get("tier", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_demand_of_a_real_fleet_and_its_exporter(env):
    """Two workers: running is summed over them, the estimate is the fleet's, the depth is the broker's."""
    env.configure(demand_target={"offline": 5.0})
    for _ in range(2):
        env.start_worker(concurrency=2)  # one slot each for offline (the other is kept for realtime)
    sleep = env.app.tasks["t.sleep"]
    for i in range(40):
        sleep.apply_async((f"o{i}", 1.0), tier="offline")
    settings = load_settings(env.app.conf)

    def offline() -> dict:
        return cluster_status(env.app, settings, env.adapter)["tiers"]["offline"]

    env.wait_for(lambda: offline()["runtime_estimate_s"] is not None and offline()["running"] == 2, timeout=30)
    row = offline()
    assert row["running"] == 2 and 0.9 <= row["runtime_estimate_s"] <= 1.5, row
    # 40 published, 2 running, a few done by now: how many depends on how long the status calls took (each
    # waits up to 1 s for the workers' replies), so the bound is loose; the formula is checked exactly.
    assert 20 <= row["waiting"] <= 38, row
    assert row["demand_slots"] == slots_needed(row["waiting"], 2, row["runtime_estimate_s"], 5.0)
    assert row["demand_slots"] >= 2 + row["waiting"] // 5, row  # the rest drained in 5 s at about 1 s each
    status = cluster_status(env.app, settings, env.adapter)
    assert len(status["workers"]) == 2 and status["tiers"]["realtime"]["demand_slots"] == 0

    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "prio", "exporter", "--port", str(port)],
        env={**os.environ, **env.worker_env()},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                metrics = _scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert metrics[("celery_prio_fleet_workers", "")] == 2
        assert metrics[("celery_prio_fleet_running", "offline")] == 2
        assert metrics[("celery_prio_demand_slots", "offline")] >= 2 + 20 // 5  # the backlog drains meanwhile
        assert metrics[("celery_prio_demand_slots", "realtime")] == 0
    finally:
        exporter.kill()
        exporter.wait(10)
