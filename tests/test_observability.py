"""Per-tier figures where operators look: inspect, `prio status`, Prometheus, Flower."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from celery_prio.tiers import Tier
from celery_prio.tools.workers import free_port
from tests.conftest import ROOT

pytestmark = [pytest.mark.broker, pytest.mark.slow]

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def fill(env):
    """Some work done on every tier, and a known backlog left in batch and offline."""
    sleep = env.app.tasks["t.sleep"]
    done = [sleep.apply_async((f"d{i}", 0.01), tier=t) for i, t in enumerate(["realtime", "batch", "offline"] * 3)]
    for r in done:
        r.get(timeout=20)
    env.app.control.cancel_consumer(env.queue(B), reply=True, timeout=2)
    env.app.control.cancel_consumer(env.queue(O), reply=True, timeout=2)
    time.sleep(0.3)
    for i in range(4):
        sleep.apply_async((f"b{i}", 0), tier="batch")
    for i in range(7):
        sleep.apply_async((f"o{i}", 0), tier="offline")


def test_inspect_prio_stats_and_prio_status_match_the_broker(env):
    env.start_worker(concurrency=2)
    fill(env)
    from celery_prio.worker.control import collect_prio_stats

    stats = collect_prio_stats(env.app, timeout=3, limit=1)
    (reply,) = stats.values()
    assert set(reply["tiers"]) == {"realtime", "batch", "offline"}
    for tier in ("realtime", "batch", "offline"):
        row = reply["tiers"][tier]
        assert row["dispatched"] == 3 and row["finished"] == 3
        assert row["wait_p99_ms"] is not None and row["run_p50_ms"] is not None
    data = json.loads(env.prio_cli("status", "--json"))
    depths = {t: r["depth"] for t, r in data["tiers"].items()}
    assert depths == {"realtime": 0, "batch": 4, "offline": 7} == {t.label: env.depth(t) for t in (R, B, O)}
    assert data["tiers"]["realtime"]["dispatched"] == 3
    assert len(data["workers"]) == 1
    table = env.prio_cli("status")
    assert "offline" in table and "dead letters" in table


def test_prometheus_endpoint_parses_with_per_tier_series(env):
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    env.configure(metrics_port=port)
    env.start_worker(concurrency=2)
    fill(env)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    depth = {s.labels["tier"]: s.value for s in families["celery_prio_queue_depth"].samples}
    assert depth == {"realtime": 0, "batch": 4, "offline": 7}
    dispatched = {
        s.labels["tier"]: s.value for s in families["celery_prio_dispatched"].samples if s.name.endswith("_total")
    }
    assert dispatched == {"realtime": 3, "batch": 3, "offline": 3}
    buckets = [s for s in families["celery_prio_wait_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["tier"] for s in buckets} == {"realtime", "batch", "offline"}
    counts = [s for s in families["celery_prio_wait_seconds"].samples if s.name.endswith("_count")]
    assert all(s.value == 3 for s in counts)
    slice_length = {s.labels["tier"]: s.value for s in families["celery_prio_slice_seconds"].samples}
    assert slice_length == {"batch": 0.1, "offline": 0.1}  # half of prio_realtime_target; realtime: no series
    yields = {s.labels["tier"]: s.value for s in families["celery_prio_yields"].samples if s.name.endswith("_total")}
    assert yields == {"realtime": 0, "batch": 0, "offline": 0}


def _management_api() -> str | None:
    """The local RabbitMQ management API (Flower reads RabbitMQ queue lengths there), if it answers."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", 15672), timeout=1).close()
    except OSError:
        return None
    return "http://guest:guest@127.0.0.1:15672/api/"


@pytest.mark.parametrize("kind", ["redis", "amqp"])
def test_flower_shows_prio_figures_and_the_tier_queues(kind, tmp_path):
    from tests.conftest import _one_broker_env

    pytest.importorskip("flower")
    broker_api = _management_api() if kind == "amqp" else None
    if kind == "amqp" and broker_api is None:
        if os.environ.get("CI") == "true":
            pytest.fail("RabbitMQ's management API is off: .ci/run enables it for Flower's broker page")
        pytest.skip("RabbitMQ's management API is off (Flower reads RabbitMQ queue lengths there)")
    envs = _one_broker_env(kind, tmp_path)
    env = next(envs)
    try:
        _flower_checks(env, tmp_path, broker_api)
    finally:
        next(envs, None)


def _flower_checks(env, tmp_path, broker_api: str | None) -> None:
    worker = env.start_worker(concurrency=2)
    sleep = env.app.tasks["t.sleep"]
    for r in [sleep.apply_async((f"d{i}", 0.01), tier=t) for i, t in enumerate(["realtime", "batch", "offline"])]:
        r.get(timeout=20)
    port = free_port()
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.workerapp",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--basic-auth=ops:secret",
            *([f"--broker-api={broker_api}"] if broker_api else []),
        ],
        env={**os.environ, **env.worker_env()},
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def get(path: str):
            request = urllib.request.Request(base + path)
            request.add_header("Authorization", "Basic " + base64.b64encode(b"ops:secret").decode())
            return json.loads(urllib.request.urlopen(request, timeout=10).read())

        deadline = time.time() + 60
        workers: dict = {}
        while time.time() < deadline:
            try:
                workers = get("/api/workers?refresh=1")
                if workers and all("stats" in w for w in workers.values()):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        (info,) = workers.values()
        # The worker page: one readable row per tier, e.g. "wait p99 3 ms · share 33 % of 18 % · depth 0 · ...".
        rows = {k: v for k, v in info["stats"].items() if k.startswith("prio ")}
        assert set(rows) == {"prio realtime", "prio batch", "prio offline"}
        assert "done 1" in rows["prio batch"] and "depth 0" in rows["prio batch"], rows
        # The tier queues, and the sub-queue realtime calls of t.sleep wait in (shortest job first).
        realtime_sleep = f"{env.queue(R)}.sjf-t-sleep"
        listed = {q["name"] for q in info["active_queues"]}
        assert listed >= {env.queue(t) for t in (R, B, O)} | {realtime_sleep}
        # Only queues of this app's tiers (on RabbitMQ also those its workers declare up front: realtime-tiered
        # and batched tasks'); never a per-task queue of a task that was not called there (Celery's built-ins).
        assert all(name.startswith(env.prefix + ".") for name in listed), listed
        assert not any(".sjf-celery" in name for name in listed), listed
        # Leave a backlog nobody takes, and read its length through Flower's broker page.
        worker.kill()
        for i in range(4):
            sleep.apply_async((f"b{i}", 0), tier="batch")
        for i in range(7):
            sleep.apply_async((f"o{i}", 0), tier="offline")
        for i in range(3):
            sleep.apply_async((f"r{i}", 0), tier="realtime")
        deadline = time.time() + 30  # RabbitMQ's management API refreshes its figures every few seconds
        while True:
            queues = {q["name"]: q.get("messages") for q in get("/api/queues/length")["active_queues"]}
            if (queues.get(realtime_sleep) == 3 and queues.get(env.queue(O)) == 7) or time.time() > deadline:
                break
            time.sleep(1)
        assert queues[env.queue(B)] == 4 and queues[env.queue(O)] == 7 and queues[env.queue(R)] == 0
        assert queues[realtime_sleep] == 3, "realtime calls waiting in their sub-queue show in Flower"
    finally:
        flower.kill()
        flower.wait(10)
        log.close()


def test_garbage_at_a_tier_head_or_in_the_dead_letters_breaks_no_report(redis_env):
    """A JSON list at a tier's head used to make prio_stats fail and /metrics answer 500."""
    from celery_prio.worker.control import collect_prio_stats

    env = redis_env
    port = free_port()
    env.configure(metrics_port=port, aging={"batch": None, "offline": None})
    env.start_worker(concurrency=2, queues=[env.queue(R)])  # nobody takes the garbage off offline
    env.adapter.client.lpush(env.queue(O), b"[1, 2]")
    env.adapter.client.lpush(f"{env.prefix}.dead", b"[3]", b"\xff not json")
    (reply,) = collect_prio_stats(env.app, timeout=3, limit=1).values()
    assert reply["tiers"]["offline"]["oldest_wait_s"] is None
    response = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status == 200 and b"celery_prio_queue_depth" in response.read()
    data = json.loads(env.prio_cli("status", "--json"))
    assert data["tiers"]["offline"]["depth"] == 1 and data["dead"] == 2
    listed = json.loads(env.prio_cli("dead", "list", "--json"))
    assert [d["reason"] for d in listed] == ["malformed dead-letter entry"] * 2
    assert "2 shown" in env.prio_cli("dead", "list")
