"""Per-tier capacity on real Redis and RabbitMQ, no worker running."""

from __future__ import annotations

import threading
import time

import pytest

from celery_prio import QueueFull, Tier

pytestmark = pytest.mark.broker

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def test_full_realtime_tier_refuses_at_once_with_429(env):
    env.configure(max_length={"realtime": 50})
    rt = env.app.tasks["t.rt_sleep"]
    for i in range(50):
        rt.delay(f"r{i}", 0)
    started = time.perf_counter()
    with pytest.raises(QueueFull) as info:
        rt.delay("r50", 0)
    elapsed = time.perf_counter() - started
    err = info.value
    assert (err.tier, err.status_code, err.waiting) == (R, 429, 50)
    assert err.retry_after >= 0
    assert str(err).startswith("realtime tier is full (50 waiting); retry after")
    assert elapsed < 0.25, elapsed
    assert env.depth(R) == 50  # nothing of the refused publish was enqueued


def test_drop_oldest_keeps_newest_and_dead_letters_the_evicted(env):
    env.configure(max_length={"offline": 20})
    sleep = env.app.tasks["t.sleep"]
    ids = [sleep.apply_async((f"o{i}", 0), tier="offline").id for i in range(30)]
    env.wait_for(lambda: env.adapter.depth(f"{env.prefix}.dead") == 10, timeout=10, what="10 dead letters")
    assert env.depth(O) == 20
    from celery_prio import settings_for

    dead = env.adapter.dead_list(settings_for(env.app), limit=100)
    assert sorted(d["id"] for d in dead) == sorted(ids[:10])  # exactly the 10 oldest
    assert {d["reason"] for d in dead} == {"drop_oldest"}
    assert {d["queue"] for d in dead} == {env.queue(O)}
    out = env.prio_cli("dead", "list")
    assert ids[0] in out
    # Requeue: the tier is full, so nothing moves until there is room.
    assert "requeued 0; 10 left" in env.prio_cli("dead", "requeue")
    with env.app.connection_for_write() as conn:  # make room: take 10 off the tier
        channel = conn.channel()
        for _ in range(10):
            channel.basic_get(queue=env.queue(O), no_ack=True)
    assert "requeued 10; 0 left" in env.prio_cli("dead", "requeue")
    assert env.depth(O) == 20


def test_racing_publishers_never_exceed_the_cap(env):
    env.configure(max_length={"batch": 100})
    sleep = env.app.tasks["t.sleep"]
    accepted, refused = [], []
    lock = threading.Lock()

    def publish(n: int) -> None:
        for i in range(40):
            try:
                sleep.apply_async((f"b{n}-{i}", 0), tier="batch")
                with lock:
                    accepted.append(1)
            except QueueFull:
                with lock:
                    refused.append(1)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) + len(refused) == 320
    assert env.depth(B) == len(accepted) == 100


def test_redis_counts_rejected_and_dropped_per_tier(redis_env):
    env = redis_env
    env.configure(max_length={"realtime": 2, "offline": 2})
    for i in range(3):
        env.app.tasks["t.sleep"].apply_async((f"o{i}", 0), tier="offline")
    with pytest.raises(QueueFull):
        for i in range(3):
            env.app.tasks["t.rt_sleep"].delay(f"r{i}", 0)
    from celery_prio import settings_for

    counters = env.adapter.counters(settings_for(env.app))
    assert counters == {"rejected:realtime": 1, "dropped:offline": 1}


@pytest.mark.slow
def test_changing_a_cap_on_an_existing_rabbitmq_queue_does_not_crash(tmp_path):
    from tests.conftest import PrioEnv, need_broker

    need_broker("amqp")
    env = PrioEnv("amqp", tmp_path)
    try:
        env.configure(max_length={"realtime": 50})
        env.app.tasks["t.rt_sleep"].delay("before", 0)
        env.configure(max_length={"realtime": 10})  # same queue, new cap
        worker = env.start_worker(concurrency=2)
        assert env.app.tasks["t.rt_sleep"].delay("after", 0).get(timeout=15) == "after"
        assert "exists with other arguments" in worker.log()
    finally:
        env.close()


def test_producer_batch_cannot_bypass_a_cap(env):
    """kombu's Producer.batch() pipelines publishes; a capped tier must still refuse past its cap."""
    env.configure(max_length={"batch": 5})
    sleep = env.app.tasks["t.sleep"]
    accepted = 0
    with env.app.producer_or_acquire() as producer, pytest.raises(QueueFull) as info, producer.batch():
        for i in range(10):
            sleep.apply_async((f"b{i}", 0), tier="batch", producer=producer)
            accepted += 1
    assert accepted == 5 and info.value.tier is B
    assert env.depth(B) == 5


def test_uncapped_queues_still_batch(redis_env):
    """Only capped tier queues leave the pipeline: other queues keep kombu's batching."""
    env = redis_env
    env.configure(max_length={"batch": None})
    sleep = env.app.tasks["t.sleep"]
    with env.app.producer_or_acquire() as producer, producer.batch():
        for i in range(20):
            sleep.apply_async((f"b{i}", 0), tier="batch", producer=producer)
        assert env.depth(B) == 0  # still buffered in the pipeline
    assert env.depth(B) == 20


def test_a_garbage_drain_rate_entry_still_gives_queue_full(redis_env):
    env = redis_env
    env.configure(max_length={"realtime": 1})
    env.adapter.client.hset(f"{env.prefix}.stats.rates", "w|realtime", "not a rate")
    rt = env.app.tasks["t.rt_sleep"]
    rt.delay("r0", 0)
    with pytest.raises(QueueFull) as info:
        rt.delay("r1", 0)
    assert info.value.retry_after == QueueFull.default_retry_after


def test_rabbitmq_refusals_share_one_management_client(amqp_env):
    from celery_prio import settings_for
    from celery_prio.brokers.amqp.management import management_client

    env = amqp_env
    env.configure(max_length={"realtime": 1})
    rt = env.app.tasks["t.rt_sleep"]
    rt.delay("r0", 0)
    client = management_client(env.app, settings_for(env.app))
    before = client.requests
    started = time.monotonic()
    refused = 0
    for i in range(30):
        try:
            rt.delay(f"r{i + 1}", 0)
        except QueueFull:
            refused += 1
    elapsed = time.monotonic() - started
    assert refused == 30
    # One cached answer per second per queue (a closed keep-alive connection costs one retry), not one per refusal.
    assert client.requests - before <= 2 * (2 + elapsed), (client.requests - before, elapsed)
