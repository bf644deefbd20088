"""Every structure is bounded (issue 26): the dead letters have a cap and a metric, the fleet's Redis
hashes are pruned of names nobody mentioned for ``prio_prune_after``, and RabbitMQ's boost memory is
bounded by bytes, not only by count. Real brokers, real workers where a worker does the work."""

from __future__ import annotations

import json
import socket
import time

from celery_prio import settings_for
from celery_prio.brokers.amqp.boost import RecentPublishes, approx_size
from celery_prio.brokers.redis.pruning import mention, prune, seen_key
from celery_prio.settings import load_settings
from celery_prio.tiers import Tier
from celery_prio.worker.control import collect_prio_stats


def test_the_dead_letters_stay_under_their_cap_and_what_went_is_counted(env):
    env.configure(dead_letter_max=100)
    settings = settings_for(env.app)
    node = f"capped-{env.prefix}@{socket.gethostname()}"
    env.start_worker(concurrency=1, hostname=node)  # declares the queues (RabbitMQ: the cap is x-max-length)
    entries = [json.dumps({"headers": {"prio_dead_reason": "test", "n": i}, "message": "x"}) for i in range(130)]
    if env.kind == "redis":
        env.adapter.client.lpush(settings.dead_letter_queue, *entries)
    else:
        with env.app.connection_for_write() as conn:
            producer = conn.Producer()
            for entry in entries:
                producer.publish(entry, routing_key=settings.dead_letter_queue, exchange="")
    env.wait_for(lambda: env.adapter.depth(settings.dead_letter_queue) == 100, timeout=15, what="the cap")
    time.sleep(2.5)  # the worker's figures are read every 2 s
    # Only this test's worker: another's on this broker would answer too.
    (report,) = collect_prio_stats(env.app, timeout=5, limit=1, destination=[node]).values()
    assert report["dead_letters"] == 100
    if env.kind == "redis":
        assert report["dead_dropped"] == 30
        newest = json.loads(env.adapter.client.lindex(settings.dead_letter_queue, 0))
        assert newest["headers"]["n"] == 129  # the oldest went, the newest stayed


def test_a_bad_dead_letter_cap_is_refused_with_its_name():
    import pytest

    from celery_prio.errors import ConfigError

    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match=r"prio_dead_letter_max must be a whole number >= 1 or None"):
            load_settings({}, {"dead_letter_max": bad})
    assert load_settings({}, {"dead_letter_max": None}).dead_letter_max is None


def test_the_fleets_hashes_are_pruned_of_names_nobody_mentioned(redis_env):
    env = redis_env
    env.configure(prune_after=3600)
    settings = settings_for(env.app)
    client = env.adapter.client
    now = time.time()
    client.hset(settings.heartbeats_key, mapping={"old@h#1": f"{now - 7200:.6f}", "new@h#2": f"{now:.6f}"})
    client.hset(settings.serving_key, mapping={"old@h#1": "batch", "new@h#2": "batch"})
    rates = f"{settings.stats_key}.rates"
    client.hset(rates, mapping={"old@h#1|batch": f"1.0 {now - 7200:.3f}", "new@h#2|batch": f"1.0 {now:.3f}"})
    estimates = f"{settings.queue_prefix}.estimates"
    client.hset(estimates, mapping={"gone-task": "0.1", "used-task": "0.2", "unstamped": "0.3"})
    client.hset(seen_key(settings, "estimates"), mapping={"gone-task": f"{now - 7200:.3f}"})
    mention(client, settings, "estimates", ["used-task"])
    idle, busy = settings.subqueue_name(Tier.BATCH, "idle"), settings.subqueue_name(Tier.BATCH, "busy")
    client.sadd(settings.subqueue_registry, idle, busy)
    client.hset(seen_key(settings, "subqueues"), mapping={idle: f"{now - 7200:.3f}", busy: f"{now - 7200:.3f}"})
    client.lpush(busy, b"a message waits here")
    version = int(client.get(settings.subqueue_registry_version) or 0)
    try:
        gone = prune(client, settings, "pruner")
        assert gone == {"heartbeats": 1, "rates": 1, "estimates": 1, "subqueues": 1}
        assert client.hkeys(settings.heartbeats_key) == [b"new@h#2"] and client.hkeys(settings.serving_key) == [
            b"new@h#2"
        ]
        assert client.hkeys(rates) == [b"new@h#2|batch"]
        assert sorted(client.hkeys(estimates)) == [b"unstamped", b"used-task"]  # unstamped: its time starts now
        assert client.smembers(settings.subqueue_registry) == {busy.encode()}  # a queue with messages stays
        assert int(client.get(settings.subqueue_registry_version)) == version + 1  # workers re-read it
        assert prune(client, settings, "another") == {}  # one pruner a minute for the fleet
    finally:
        client.delete(busy)


def test_boost_memory_is_bounded_by_bytes_and_weighing_a_big_batch_is_cheap():
    settings = load_settings({}, {"boost_memory": 10_000, "boost_memory_bytes": 1_000_000})
    memory = RecentPublishes()
    memory.watch(settings)
    queue = settings.queue_name(Tier.BATCH)
    for i in range(10):
        headers = {"id": f"t{i}"}
        memory.before_publish(body=(["x" * 300_000], {}, {}), routing_key=queue, headers=headers)
        memory.after_publish(headers=headers)
    assert memory.bytes <= 1_000_000 and memory.get("t9") is not None and memory.get("t0") is None
    big = memory.before_publish  # a message bigger than the whole memory is not kept at all
    headers = {"id": "huge"}
    big(body=(["x" * 2_000_000], {}, {}), routing_key=queue, headers=headers)
    memory.after_publish(headers=headers)
    assert memory.get("huge") is None and memory.get("t9") is not None
    batch = [[0.5] * 3072 for _ in range(4096)]  # a 4,096-image batch as lists of floats
    started = time.perf_counter()
    weight = approx_size((batch, {}, {}))
    assert time.perf_counter() - started < 0.05
    assert 4096 * 3072 * 8 <= weight <= 4096 * 3072 * 32
