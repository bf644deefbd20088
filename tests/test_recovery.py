"""Prompt recovery on Redis (issue 16): a dead worker's in-flight messages return within their tier's bound.

Real Redis, real workers, kombu's visibility timeout left at an hour: what
brings the messages back is the owner/heartbeat sweep, not kombu's restore.
"""

from __future__ import annotations

import json
import time

import pytest

from celery_prio.brokers.redis.housekeeping import SWEEP_BATCH
from celery_prio.brokers.redis.scripts import SWEEP_DEAD_OWNERS
from celery_prio.settings import load_settings
from celery_prio.tiers import Tier

BOUNDS = {"realtime": 2, "batch": 4, "offline": 6}
SLACK = 2.5  # one heartbeat and one sweep interval, plus this box's scheduling noise


def events(env, tag: str, kind: str) -> list[float]:
    return [x["t"] for x in env.log() if x["kind"] == kind and x["tag"] == tag]


def test_a_killed_workers_in_flight_tasks_come_back_within_their_tiers_bound_and_run_once(redis_env):
    env = redis_env
    env.configure(redeliver_after=BOUNDS, reserve=0)
    doomed = env.start_worker(concurrency=4)
    tasks = {"realtime": "t.rt_late", "batch": "t.batch_late", "offline": "t.slow_late"}
    results = {tier: env.app.tasks[name].apply_async((tier, 3.0)) for tier, name in tasks.items()}
    env.wait_for(lambda: all(events(env, tier, "start") for tier in tasks), what="all three to start")
    env.start_worker(concurrency=4)  # the survivor
    time.sleep(0.5)
    killed_at = time.time()
    doomed.kill()  # SIGKILL, worker and pool: nothing is acked
    for result in results.values():
        assert result.get(timeout=30) in tasks
    time.sleep(0.5)
    for tier in tasks:
        starts, ends = events(env, tier, "start"), events(env, tier, "end")
        assert len(starts) == 2 and len(ends) == 1, (tier, starts, ends)  # cut off once, completed once
        back_after = starts[1] - killed_at
        assert back_after <= BOUNDS[tier] + SLACK, (tier, back_after)
        assert back_after >= BOUNDS[tier] - 1.5, (tier, back_after)  # not before the owner was silent long enough
    settings = load_settings(env.app.conf)
    assert env.adapter.client.hlen(settings.owners_key) == 0  # settled messages leave no owner behind


def test_a_long_task_on_a_live_worker_is_never_returned(redis_env):
    """A 12 s task, six times its tier's bound, on a worker that keeps beating while another worker sweeps."""
    env = redis_env
    env.configure(redeliver_after={"realtime": 2})
    env.start_worker(concurrency=2)
    env.start_worker(concurrency=2)
    result = env.app.tasks["t.rt_late"].apply_async(("long", 12.0))
    assert result.get(timeout=30) == "long"
    assert len(events(env, "long", "start")) == 1


def test_a_task_that_holds_the_solo_pools_loop_is_never_taken_for_dead(redis_env):
    """The solo pool runs a task on the worker's event loop: the beat comes from a thread, so a 7 s task
    (over three times its bound) is not returned and run again by the other worker meanwhile."""
    env = redis_env
    env.configure(redeliver_after={"realtime": 2})
    env.start_worker(concurrency=1, pool="solo")
    result = env.app.tasks["t.rt_late"].apply_async(("solo", 7.0))
    env.wait_for(lambda: events(env, "solo", "start"), what="the task to start")
    env.start_worker(concurrency=2)  # a sweeper that would take the solo worker for dead
    assert result.get(timeout=30) == "solo"
    time.sleep(1.0)
    assert len(events(env, "solo", "start")) == 1


def test_the_default_bounds_are_at_most_ten_seconds_for_every_tier():
    assert max(load_settings({}).redeliver_after.values()) <= 10


def test_a_sweep_reads_the_owners_in_bounded_chunks_and_finds_a_dead_owner_anywhere(redis_env):
    """20,000 in-flight records of a live owner and, among them, a dead one's: every sweep call reads one
    bounded chunk (Redis serves others in between) and the dead owner's message still comes back."""
    env = redis_env
    env.configure(redeliver_after={"realtime": 2, "batch": 2, "offline": 2})
    settings = load_settings(env.app.conf)
    client = env.adapter.client
    live = "alive@host#1"
    client.hset(settings.heartbeats_key, live, f"{time.time() + 3600:.6f}")  # beats "an hour ahead": never due
    mapping = {f"live-{i}": f"{live}|batch|{time.time():.6f}" for i in range(20_000)}
    client.hset(settings.owners_key, mapping=mapping)
    sweep = client.register_script(SWEEP_DEAD_OWNERS)
    keys = [settings.owners_key, settings.heartbeats_key, f"{env.prefix}.test-lock", f"{env.prefix}.test-cursor"]
    try:
        calls = 0
        while True:  # the sweep's calls, one chunk each, as a worker makes them
            reply = sweep(keys=keys, args=["tester", SWEEP_BATCH, "batch", 3600], client=client)
            calls += 1
            assert len(reply) == 1  # nothing due under an hour's bound
            if reply[0] == b"0":
                break
        assert calls >= 20_000 // (2 * SWEEP_BATCH)  # chunks, not the whole hash in one call
        client.hset(settings.owners_key, "dead-tag", "dead@host#2|batch|1.0")
        env.start_worker(concurrency=1)
        env.wait_for(lambda: not client.hexists(settings.owners_key, "dead-tag"), timeout=15, what="the sweep")
        assert client.hlen(settings.owners_key) == 20_000  # the live owner's records are all still there
    finally:
        client.delete(settings.owners_key, keys[2], keys[3])
        client.hdel(settings.heartbeats_key, live)


def test_an_idle_fleets_sweep_takes_no_lock_and_moves_no_cursor(redis_env):
    """Nothing in flight (no owners hash): the sweep ends at its first command, every second, and when a message
    is in flight again (a worker died holding it) it sweeps as before."""
    from celery_prio.brokers.redis.housekeeping import sweep_keys

    env = redis_env
    env.configure(redeliver_after={"realtime": 2, "batch": 2, "offline": 2})
    settings = load_settings(env.app.conf)
    client = env.adapter.client
    lock, cursor = sweep_keys(settings)
    env.start_worker(concurrency=1)
    assert env.app.tasks["t.sleep"].delay("warm", 0).get(timeout=15) == "warm"  # the fleet's jobs under way
    env.wait_for(lambda: not client.exists(settings.owners_key), what="nothing in flight")
    client.delete(lock, cursor)
    seen, end = 0, time.monotonic() + 2.5  # two sweeps at least; the lock lives 0.9 s of each second it is taken
    while time.monotonic() < end:
        seen += client.exists(lock, cursor)
        time.sleep(0.05)
    assert seen == 0, "the idle fleet's sweep took its lock or moved its cursor"
    client.hset(settings.owners_key, "gone-tag", "w-dead@host|batch|1.0")
    env.wait_for(lambda: not client.hexists(settings.owners_key, "gone-tag"), timeout=10, what="the sweep")
    assert client.exists(cursor)


def test_the_sweep_touches_only_this_apps_messages(redis_env):
    env = redis_env
    env.configure(redeliver_after={"realtime": 2, "batch": 2, "offline": 2})
    settings = load_settings(env.app.conf)
    client = env.adapter.client
    # Another app's message, unacked for a day by a worker that is long gone: not ours to return.
    foreign = json.dumps([{"headers": {"id": "other"}, "properties": {"delivery_tag": "foreign-tag"}}, "", "other.q"])
    client.hset("unacked", "foreign-tag", foreign)
    client.zadd("unacked_index", {"foreign-tag": time.time() - 86400})
    # One of ours whose message was settled already (only the owner record is left): dropped, nothing pushed.
    client.hset(settings.owners_key, "gone-tag", "w-dead@host|batch|1.0")
    try:
        env.start_worker(concurrency=2)
        env.wait_for(lambda: not client.hexists(settings.owners_key, "gone-tag"), timeout=10, what="the sweep")
        time.sleep(1.5)
        assert client.hget("unacked", "foreign-tag") is not None and client.llen("other.q") == 0
        assert client.llen(env.queue(Tier.BATCH)) == 0
    finally:
        client.hdel("unacked", "foreign-tag")
        client.zrem("unacked_index", "foreign-tag")


@pytest.mark.parametrize("bad", [1.0, "soon", -5])
def test_a_bound_below_two_heartbeats_is_refused(bad):
    from celery_prio.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prio_redeliver_after\[realtime\] must be a number >= 2"):
        load_settings({}, {"redeliver_after": {"realtime": bad}})
