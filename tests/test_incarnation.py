"""Recovery keyed to worker incarnations, and poison at any depth (issue 26, Redis; real Redis and workers).

* A worker restarted in place (same node name: a pod or systemd unit coming
  back) is a new owner, so what its dead incarnation had in flight comes back.
* A message nested deeper than Python's JSON decoder allows (Redis' cjson
  takes 1,000 levels, Python stops near 996) is dead-lettered with its reason
  and cleans up after itself, at fetch and when a dead worker's messages are
  swept: nothing stays unacked, nothing behind it is stranded.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid

import pytest
import redis

from celery_prio.headers import DEAD_REASON
from celery_prio.settings import load_settings
from celery_prio.tiers import Tier
from celery_prio.tools.chaos import redis_server

pytestmark = [pytest.mark.broker, pytest.mark.slow]

#: Nesting Redis' cjson decodes and Python's json does not (RecursionError).
TOO_DEEP = 998


def events(env, tag: str, kind: str) -> list[float]:
    return [x["t"] for x in env.log() if x["kind"] == kind and x["tag"] == tag]


def test_a_worker_restarted_in_place_gets_its_dead_incarnations_work_back(redis_env):
    env = redis_env
    env.configure(redeliver_after={"batch": 3}, reserve=0)
    node = f"pod-{env.prefix}@%h"  # a restarted pod keeps its name
    doomed = env.start_worker(concurrency=2, hostname=node)
    result = env.app.tasks["t.batch_late"].apply_async(("inflight", 2.0))
    env.wait_for(lambda: events(env, "inflight", "start"), what="the acks_late task to start")
    doomed.kill()  # SIGKILL (an OOM kill): nothing acked
    killed_at = time.time()
    env.start_worker(concurrency=2, hostname=node)  # the same name, a new incarnation
    assert result.get(timeout=30) == "inflight"
    starts = events(env, "inflight", "start")
    assert len(starts) == 2 and len(events(env, "inflight", "end")) == 1, starts
    assert starts[1] - killed_at < 3 + 3.5, starts[1] - killed_at  # its tier's bound, a beat and a sweep
    time.sleep(0.5)
    settings = load_settings(env.app.conf)
    assert env.adapter.client.hlen(settings.owners_key) == 0


def deep_element(env) -> tuple[str, bytes]:
    """(delivery tag, raw element): a real task envelope carrying a field nested ``TOO_DEEP`` levels."""
    env.app.tasks["t.add"].apply_async((1, 2), tier="batch")
    message = json.loads(env.adapter.client.rpop(env.queue(Tier.BATCH)))
    tag = str(uuid.uuid4())
    message["properties"]["delivery_tag"] = tag
    encoded = json.dumps(message)
    return tag, (encoded[:-1] + ', "x-deep": ' + "[" * TOO_DEEP + "]" * TOO_DEEP + "}").encode()


def dead_reasons(env) -> list[str]:
    out = []
    for raw in env.adapter.client.lrange(f"{env.prefix}.dead", 0, -1):
        try:
            out.append(json.loads(raw)["headers"][DEAD_REASON])
        except (ValueError, KeyError, TypeError, RecursionError):
            out.append(f"(unreadable dead entry of {len(raw)} bytes)")
    return out


def test_a_message_too_deep_for_python_is_dead_lettered_at_fetch_and_leaves_nothing_unacked(redis_env):
    env = redis_env
    tag, raw = deep_element(env)
    env.adapter.client.lpush(env.queue(Tier.BATCH), raw)
    good = env.app.tasks["t.add"].apply_async((2, 3), tier="batch")  # behind it
    env.start_worker(concurrency=2)
    assert good.get(timeout=20) == 5
    reasons = dead_reasons(env)
    assert len(reasons) == 1 and "too deeply nested" in reasons[0], reasons
    settings = load_settings(env.app.conf)
    client = env.adapter.client
    assert not client.hexists(f"{settings.queue_prefix}.unacked", tag)
    assert not client.hexists(settings.owners_key, tag)


def test_a_sweep_goes_past_a_message_too_deep_for_python(redis_env):
    """A gone worker's messages: the deep one first in the sweep, a good one behind it; both settle."""
    env = redis_env
    env.configure(redeliver_after={"batch": 2})
    settings = load_settings(env.app.conf)
    client = env.adapter.client
    tag, raw = deep_element(env)
    env.app.tasks["t.sleep"].apply_async(("swept", 0), tier="batch")
    good_raw = client.rpop(env.queue(Tier.BATCH))
    good_tag = json.loads(good_raw)["properties"]["delivery_tag"]
    unacked, index = f"{settings.queue_prefix}.unacked", f"{settings.queue_prefix}.unacked_index"
    for t, element in ((tag, raw), (good_tag, good_raw)):  # as the fetch script records them
        client.hset(unacked, t, b"[" + element + b',"",' + json.dumps(env.queue(Tier.BATCH)).encode() + b"]")
        client.zadd(index, {t: time.time()})
        client.hset(settings.owners_key, t, f"w-gone-{env.prefix}@host#dead|batch|1.0")
    env.start_worker(concurrency=2)
    env.wait_for(lambda: events(env, "swept", "end"), timeout=20, what="the good message behind the deep one")
    env.wait_for(lambda: client.hlen(settings.owners_key) == 0, timeout=10, what="no owner left")
    assert not client.hexists(unacked, tag) and not client.hexists(unacked, good_tag)
    reasons = dead_reasons(env)
    assert len(reasons) == 1 and "too deeply nested" in reasons[0], reasons


def private_redis(tmp_path):
    """``(port, server)``: a redis-server of the test's own (AOF, fsync always), to SIGKILL and restart."""
    from celery_prio.tools.workers import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary to run a private Redis")
    port = free_port()
    return port, redis_server(port, tmp_path / "redis")


def test_a_redis_restart_under_acks_late_load_keeps_the_worker_up_and_completes_every_task(tmp_path):
    """Redis SIGKILLed and restarted from its AOF mid-load: the worker reconnects, every accepted task runs."""
    from tests.conftest import PrioEnv

    port, server = private_redis(tmp_path)
    env = PrioEnv("redis", tmp_path, broker=f"redis://127.0.0.1:{port}/0")
    try:
        env.configure(redeliver_after={"batch": 3})
        task = env.app.tasks["t.batch_late"]
        n = 300
        for i in range(n):
            task.apply_async((f"load-{i}", 0.02))  # all accepted before the restart (appendfsync always)
        worker = env.start_worker(concurrency=4)
        env.wait_for(lambda: len(ended(env)) >= 60, timeout=30, what="the load to be under way")
        # One more waits on the worker's timer (countdown) across the restart: it runs once, not lost, not twice.
        env.app.tasks["t.sleep"].apply_async(("load-eta", 0.0), countdown=3, tier="realtime")
        time.sleep(1.0)  # fetched at once: realtime keeps a slot in reserve
        server.kill()  # SIGKILL
        server.wait(10)
        time.sleep(1.0)
        server = redis_server(port, tmp_path / "redis")
        env.wait_for(lambda: len(ended(env)) == n + 1, timeout=90, what=f"all {n + 1} tasks to complete")
        assert len(events(env, "load-eta", "start")) == 1, events(env, "load-eta", "start")
        assert worker.proc.poll() is None, "the worker died across the Redis restart"
        assert "Unrecoverable error" not in worker.log()
    finally:
        env.close()
        server.kill()
        server.wait(10)


def ended(env) -> set[str]:
    return {x["tag"] for x in env.log() if x["kind"] == "end" and x["tag"].startswith("load-")}


def test_an_ack_that_fails_while_redis_is_down_is_settled_after_the_reconnect_not_run_again(tmp_path):
    """A task ends while Redis is down: its ack fails. The message is done, so the ack must neither raise
    into the worker nor leave the entry to come back: after the reconnect its unacked entry and owner go,
    and nothing is returned to the queue (it would run a second time)."""
    from celery_prio import settings_for
    from celery_prio.brokers.redis.fetch import RedisFetchSource
    from celery_prio.brokers.redis.transport import UNSETTLED
    from celery_prio.policy.served import ServedQueues
    from celery_prio.tiers import TIERS
    from tests.conftest import PrioEnv

    port, server = private_redis(tmp_path)
    env = PrioEnv("redis", tmp_path, broker=f"redis://127.0.0.1:{port}/0")
    try:
        env.app.tasks["t.batch_late"].apply_async(("once", 0.0))
        settings = settings_for(env.app)
        conn = env.app.connection_for_write()
        channel = conn.default_channel
        served = ServedQueues(settings, [settings.queue_name(t) for t in TIERS])
        source = RedisFetchSource(env.app, channel, served, settings, "acker@h#1")
        _, message = source.fetch([env.queue(Tier.BATCH)], [Tier.BATCH])
        client = redis.Redis(port=port)
        assert client.hlen(settings.owners_key) == 1
        server.kill()
        server.wait(10)
        message.ack()  # Redis is down: no exception into the worker, the settle is remembered
        assert message.delivery_tag in UNSETTLED
        server = redis_server(port, tmp_path / "redis")
        assert source.recover_own(held=set()) == 0  # what follows a reconnect: nothing to return
        assert client.hlen(settings.owners_key) == 0 and client.hlen(f"{settings.queue_prefix}.unacked") == 0
        assert client.llen(env.queue(Tier.BATCH)) == 0 and not UNSETTLED
        conn.release()
    finally:
        env.close()
        server.kill()
        server.wait(10)
