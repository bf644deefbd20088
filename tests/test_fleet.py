"""Fleet scale (issue 28): an idle worker costs the broker (nearly) nothing, picks up work at once, and fleet-wide
housekeeping runs on one worker at a time. Real brokers and real workers; the figures are in
``celery-prio bench --only scale``.
"""

from __future__ import annotations

import time

import pytest
from amqp.exceptions import NotFound

from celery_prio import settings_for
from celery_prio.brokers.redis.scripts import BELL_MAX
from celery_prio.tiers import Tier
from celery_prio.worker.control import collect_prio_stats


def holder(env) -> str | None:
    raw = env.adapter.client.get(settings_for(env.app).housekeeper_key)
    return raw.decode() if raw else None


def test_one_worker_of_the_fleet_holds_the_housekeeper_lease_and_another_takes_over_when_it_dies(redis_env):
    env = redis_env
    env.configure(redeliver_after={"realtime": 3})
    first = env.start_worker(concurrency=1, hostname=f"first-{env.prefix}@%h")
    env.wait_for(lambda: holder(env) is not None, what="a housekeeper")
    assert holder(env).startswith(f"first-{env.prefix}@")  # the only worker: it keeps the fleet's jobs
    env.app.tasks["t.rt_late"].delay("in-flight", 30.0)  # acks_late, on the first worker (the only one yet)
    env.wait_for(lambda: any(x["tag"] == "in-flight" for x in env.log()), what="the task to start")
    env.start_worker(concurrency=1, hostname=f"second-{env.prefix}@%h")
    time.sleep(2.5)
    assert holder(env).startswith(f"first-{env.prefix}@")  # held while its holder beats: one housekeeper
    first.kill()  # SIGKILL: the housekeeper is gone, and with it the worker of the task in flight
    env.wait_for(lambda: (holder(env) or "").startswith(f"second-{env.prefix}@"), timeout=10, what="a new housekeeper")
    # The new housekeeper's sweep returns the dead worker's message: it runs again, on the second worker.
    env.wait_for(
        lambda: sum(x["tag"] == "in-flight" and x["kind"] == "start" for x in env.log()) == 2,
        timeout=15,
        what="the dead worker's task to run again",
    )


def test_a_doorbell_holds_at_most_bell_max_tokens_and_an_empty_fetch_silences_it(redis_env):
    env = redis_env
    settings = settings_for(env.app)
    bell = settings.bell_key(Tier.BATCH)
    for i in range(3 * BELL_MAX):
        env.app.tasks["t.sleep"].apply_async((f"b{i}", 0), tier="batch")
    assert env.adapter.client.llen(bell) == BELL_MAX  # a burst wakes at most BELL_MAX idle workers
    env.start_worker(concurrency=2)
    env.wait_for(lambda: env.depth(Tier.BATCH) == 0, what="the burst to drain")
    env.wait_for(lambda: env.adapter.client.llen(bell) == 0, what="the bell to go quiet")


def test_an_idle_worker_is_woken_by_its_tiers_bell_at_once(redis_env):
    env = redis_env
    env.start_worker(concurrency=2)
    sleep = env.app.tasks["t.sleep"]
    assert sleep.delay("warm", 0).get(timeout=10) == "warm"
    time.sleep(1.5)  # idle: blocked on its bells
    waits = []
    for i in range(5):
        sent = time.time()
        sleep.apply_async((f"lone{i}", 0), tier="offline")
        env.wait_for(lambda i=i: any(x["tag"] == f"lone{i}" for x in env.log()), what="the lone task")
        waits.append(next(x["t"] for x in env.log() if x["tag"] == f"lone{i}") - sent)
        time.sleep(0.3)
    # A poll would take up to prio_poll_interval (50 ms) and a missed bell up to a second: the bell takes ms.
    assert sorted(waits)[2] < 0.05, waits


def test_a_busy_redis_worker_does_not_ask_the_tiers_it_is_blocked_on(redis_env):
    """Its batch slot busy and its reserved slot free, the worker waits on realtime's bell: realtime is known to be
    empty until a token comes, so a batch backlog costs one fetch per task (not a second one asking realtime's every
    list each time), and a realtime arrival is still taken at once."""
    env = redis_env
    env.start_worker(concurrency=2)  # one slot for batch, one kept for realtime
    n = 60
    for i in range(n):
        env.app.tasks["t.sleep"].apply_async((f"b{i}", 0.02), tier="batch")
    # Three realtime calls during the backlog, each timed from its send: the median is what is asserted, so
    # one call that a loaded host (the whole suite on two cores) stalls for a few hundred ms does not decide.
    sent: dict[str, float] = {}
    for k, after in enumerate(("b5", "b20", "b35")):
        env.wait_for(lambda after=after: any(x["tag"] == after for x in env.log()), what=f"the backlog past {after}")
        sent[f"rt{k}"] = time.time()
        env.app.tasks["t.rt_sleep"].delay(f"rt{k}", 0.0)
    total = n + len(sent)
    env.wait_for(lambda: env.depth(Tier.BATCH) == 0 and len(env.log()) >= 2 * total, what="everything to run")
    started = {x["tag"]: x["t"] for x in env.log() if x["kind"] == "start"}
    waits = sorted(started[tag] - at for tag, at in sent.items())
    # Woken by its bell: a few ms. Not at a timeout: realtime is asked again without a token only by the
    # housekeeper's round or a full ask, a second apart.
    assert waits[1] < 0.1, waits
    (prio,) = collect_prio_stats(env.app, timeout=5, limit=1).values()
    # One fetch per task, plus the idle spells' (a few); asking realtime after every task would be 2 per task.
    assert prio["broker_calls"] <= 1.3 * total + 10, prio["broker_calls"]


def test_a_busy_rabbitmq_worker_holds_nothing_and_an_idle_one_only_what_it_is_about_to_run(amqp_env):
    env = amqp_env
    node = f"busy-{env.prefix}@%h"
    env.start_worker(concurrency=1, hostname=node)
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("long", 3.0), tier="batch")
    env.wait_for(lambda: any(x["tag"] == "long" for x in env.log()), what="the long task")
    for i in range(3):
        env.app.tasks["t.rt_sleep"].delay(f"rt{i}", 0)
    time.sleep(1.0)
    (report,) = collect_prio_stats(env.app, timeout=5, limit=1).values()
    assert report["held"] == 0  # every slot busy: no consumer, nothing pushed to it
    assert env.depth(Tier.REALTIME) == 3  # they wait in their queue, where any other worker can run them
    env.wait_for(lambda: sum(x["kind"] == "end" and x["tag"].startswith("rt") for x in env.log()) == 3,
                 timeout=15, what="the realtime tasks after the slot freed")  # fmt: skip


def test_sliced_tasks_make_no_queue_per_task_on_rabbitmq(amqp_env):
    env = amqp_env
    env.start_worker(concurrency=1)
    sliced = env.app.tasks["t.sliced"]
    blocker = sliced.apply_async(("long", 30, 0.05))
    env.wait_for(lambda: any(x["kind"] == "el" for x in env.log()), what="the sliced task to start")
    rt = env.app.tasks["t.rt_sleep"].delay("rt", 0)  # a waiting realtime task makes it yield
    assert rt.get(timeout=15) == "rt"
    assert blocker.get(timeout=30) == [i * i for i in range(30)]
    settings = settings_for(env.app)
    with env.app.connection_for_write() as conn:
        channel = conn.channel()
        with pytest.raises(NotFound):  # the old marker queue of that task id
            channel.queue_declare(queue=f"{settings.queue_prefix}.slice.{blocker.id}", passive=True)
        channel = conn.channel()
        assert channel.queue_declare(queue=f"{settings.queue_prefix}.slices", passive=True)  # the one journal
