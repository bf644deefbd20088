"""Sub-queues with real brokers and workers (issue 13): tenants share their tier's time, new ones are found."""

from __future__ import annotations

import json
import time

import pytest

from celery_prio import QueueFull


def starts(env, prefix: str) -> list[float]:
    return [x["t"] for x in env.log() if x["kind"] == "start" and x["tag"].startswith(prefix)]


#: From the first publish to a new sub-queue to its task's start, on an idle worker that serves the tier.
NEW_SUBQUEUE_BOUND = 0.1


def test_a_new_subqueue_is_served_within_100_ms_without_restart(stock_env):
    env = stock_env
    env.start_worker(concurrency=2)
    sleep = env.app.tasks["t.sleep"]
    assert sleep.delay("warm", 0).get(timeout=10) == "warm"
    waits = []
    for i in range(3):  # a new tenant each time, on both brokers, management API or not
        time.sleep(0.3)  # idle again
        sent = time.time()
        sleep.apply_async((f"late-{i}", 0), tier="batch", subqueue=f"late{i}")
        env.wait_for(lambda i=i: starts(env, f"late-{i}"), timeout=20, what=f"the new sub-queue late{i}")
        waits.append(starts(env, f"late-{i}")[0] - sent)
    assert max(waits) < NEW_SUBQUEUE_BOUND, waits


def test_a_queue_nobody_serves_is_reported(stock_env):
    env = stock_env
    from celery_prio.tiers import Tier

    env.start_worker(concurrency=1, queues=[env.queue(Tier.BATCH)])  # nobody serves realtime
    sleep = env.app.tasks["t.sleep"]
    for i in range(3):
        sleep.apply_async((f"stuck-{i}", 0), tier="realtime")
    sjf = f"{env.prefix}.realtime.sjf-t-sleep"

    def reported() -> dict:
        return json.loads(env.prio_cli("status", "--json"))

    # prio status reads it from the broker at once; the worker reports it once it has lasted a few seconds.
    env.wait_for(lambda: sjf in reported()["unserved"], timeout=20, what="prio status' unserved row")
    assert reported()["unserved"][sjf] == {"tier": "realtime", "depth": 3}
    env.wait_for(
        lambda: "no live worker serves their tier" in env.workers[0].log(), timeout=30, what="the worker's log line"
    )
    from celery_prio.worker.control import collect_prio_stats

    rows = next(iter(collect_prio_stats(env.app, timeout=2.0).values()))["unserved"]
    assert rows[sjf]["depth"] == 3 and rows[sjf]["seconds"] >= 3.0, rows
    assert len(starts(env, "stuck-")) == 0
    # Served again: a realtime worker starts, runs them, and the row goes.
    env.start_worker(concurrency=1, queues=[env.queue(Tier.REALTIME)])
    env.wait_for(lambda: len(starts(env, "stuck-")) == 3, timeout=20, what="the stuck tasks")
    env.wait_for(lambda: not reported()["unserved"], timeout=20, what="the unserved row to go")


def test_a_trickle_tenant_is_not_stuck_behind_a_flood(env):
    env.configure(reserve=0)
    sleep = env.app.tasks["t.sleep"]
    for i in range(200):  # 5 s of work for two slots
        sleep.apply_async((f"flood-{i}", 0.05), tier="batch", subqueue="flood")
    sleep.apply_async(("trickle-warm", 0), tier="batch", subqueue="trickle")  # the sub-queue exists before
    env.start_worker(concurrency=2)
    env.wait_for(lambda: starts(env, "trickle-warm"), timeout=20, what="the trickle tenant's first task")
    waits = []
    for i in range(5):
        sent = time.time()
        sleep.apply_async((f"trickle-{i}", 0.0), tier="batch", subqueue="trickle")
        env.wait_for(lambda i=i: starts(env, f"trickle-{i}"), timeout=10, what=f"trickle-{i}")
        waits.append(starts(env, f"trickle-{i}")[0] - sent)
        time.sleep(0.1)
    assert len(starts(env, "flood-")) < 200  # the flood was still queued
    # In one shared queue each would wait for the flood's backlog (seconds); here about one task.
    assert max(waits) < 1.0, waits


def test_subqueue_weights_share_slot_time(env):
    env.configure(reserve=0, subqueue_weights={"batch": {"heavy": 3}})
    sleep = env.app.tasks["t.sleep"]
    for i in range(300):
        sleep.apply_async((f"heavy-{i}", 0.03), tier="batch", subqueue="heavy")
        sleep.apply_async((f"light-{i}", 0.03), tier="batch", subqueue="light")
    env.start_worker(concurrency=2)
    env.wait_for(lambda: len(starts(env, "heavy-")) + len(starts(env, "light-")) >= 200, timeout=60, what="progress")
    heavy, light = len(starts(env, "heavy-")), len(starts(env, "light-"))
    assert heavy / light == pytest.approx(3.0, rel=0.15), (heavy, light)
    # The same figure as the workers report it (prio status / inspect prio_stats / metrics).
    rows = json.loads(env.prio_cli("status", "--json"))["subqueues"]
    assert rows[f"{env.prefix}.batch.heavy"]["share_of_tier"] == pytest.approx(0.75, abs=0.1)
    assert rows[f"{env.prefix}.batch.light"]["depth"] > 0


def test_a_subqueue_cap_refuses_with_queue_full(env):
    env.configure(subqueue_max_length={"batch": 3})
    sleep = env.app.tasks["t.sleep"]
    for i in range(3):
        sleep.apply_async((f"a-{i}", 0), tier="batch", subqueue="capped")
    with pytest.raises(QueueFull) as info:
        sleep.apply_async(("a-3", 0), tier="batch", subqueue="capped")
    assert "batch" in str(info.value)
    sleep.apply_async(("b-0", 0), tier="batch", subqueue="roomy")  # another tenant still has room
    assert env.adapter.depth(f"{env.prefix}.batch.capped") == 3


def test_subqueue_from_the_task_and_the_key_setting(redis_env):
    env = redis_env
    env.configure(subqueue_key="tests.subqueue_keys:tenant_of")
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("k-1", 0), kwargs={}, tier="batch", headers={"tenant": "x"})
    sleep.apply_async(("k-2", 0), tier="offline", subqueue="explicit")
    assert env.adapter.depth(f"{env.prefix}.batch.t-sleep") == 1  # from prio_subqueue_key
    assert env.adapter.depth(f"{env.prefix}.offline.explicit") == 1
    with pytest.raises(ValueError, match="sub-queue name 'no/slash'"):
        sleep.apply_async(("k-3", 0), subqueue="no/slash")


def test_subqueue_messages_age_into_the_upper_tier(env):
    from celery_prio.tiers import Tier

    env.configure(aging={"offline": 1, "batch": None}, aging_interval=0.2)
    sleep = env.app.tasks["t.sleep"]
    for i in range(10):
        sleep.apply_async((f"old-{i}", 0), tier="offline", subqueue="old")
    env.start_worker(concurrency=2, queues=[env.queue(Tier.REALTIME), env.queue(Tier.BATCH)])  # no offline worker
    env.wait_for(lambda: len([x for x in env.log() if x["kind"] == "end"]) >= 10, timeout=30, what="promotion")
    assert sorted(x["tag"] for x in env.log() if x["kind"] == "end") == sorted(f"old-{i}" for i in range(10))
