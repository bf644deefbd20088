"""celery_prio.bulk on real Redis and RabbitMQ: order, caps, stamps, flat memory, and workers run what it sent."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

import celery_prio
from celery_prio import BulkQueueFull, QueueFull, Tier
from celery_prio.headers import ENQUEUED_HEADER

pytestmark = pytest.mark.broker

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def test_bulk_publishes_in_input_order_and_workers_run_every_item(env):
    add = env.app.tasks["t.add"]
    before = time.time()
    ids = celery_prio.bulk(add, ((i, 1) for i in range(1000)), tier="batch", chunk=300)
    assert len(ids) == 1000 and ids[0].endswith("-0") and ids[-1].endswith("-999") and len(set(ids)) == 1000
    assert env.depth(B) == 1000
    if env.kind == "redis":  # the oldest end holds the first item, stamped like a single publish
        first = json.loads(env.adapter.client.lindex(env.queue(B), -1))
        assert first["headers"]["id"] == ids[0] and first["headers"]["task"] == "t.add"
        assert before <= first["headers"][ENQUEUED_HEADER] <= time.time()
    env.start_worker(concurrency=2)
    results = ids.results()
    assert [r.get(timeout=60) for r in results[::97]] == [i + 1 for i in range(0, 1000, 97)]
    env.wait_for(lambda: env.depth(B) == 0, timeout=60, what="the bulk backlog to drain")


def test_bulk_stops_at_a_rejecting_cap_and_names_exactly_what_went_in(env):
    env.configure(max_length={"batch": 250})
    add = env.app.tasks["t.add"]
    with pytest.raises(BulkQueueFull) as info:
        celery_prio.bulk(add, ((i, 1) for i in range(400)), tier="batch", chunk=100)
    err = info.value
    assert isinstance(err, QueueFull) and err.tier is B and err.status_code == 429
    assert len(err.accepted) == 250 and [a.rsplit("-", 1)[1] for a in err.accepted] == [str(i) for i in range(250)]
    assert "250 of the bulk publish accepted" in str(err)
    assert env.depth(B) == 250


def test_bulk_into_a_drop_oldest_tier_keeps_the_newest(env):
    env.configure(max_length={"offline": 100})
    ids = celery_prio.bulk(env.app.tasks["t.add"], ((i, 1) for i in range(150)), tier="offline", chunk=40)
    assert len(ids) == 150
    env.wait_for(lambda: env.adapter.depth(f"{env.prefix}.dead") == 50, timeout=10, what="50 dead letters")
    assert env.depth(O) == 100
    from celery_prio import settings_for

    dead = env.adapter.dead_list(settings_for(env.app), limit=100)
    assert sorted(d["id"] for d in dead) == sorted(ids[:50])


def test_bulk_reads_its_input_lazily_with_flat_memory(redis_env):
    env = redis_env
    env.configure(max_length={"batch": None})
    produced = []

    def items():
        for i in range(100_000):
            produced.append(1) if i % 10_000 == 0 else None
            yield (i, 1)

    tracemalloc.start()
    ids = celery_prio.bulk(env.app.tasks["t.add"], items(), tier="batch", chunk=1000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(ids) == 100_000 and env.depth(B) == 100_000
    assert peak < 30 * 2**20, f"peak {peak / 2**20:.1f} MiB"  # a chunk at a time, not 100,000 messages


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: celery_prio.bulk(t, [(1, 2)], tier="urgent"), ValueError, "unknown tier 'urgent'"),
        (lambda t: celery_prio.bulk(t, [(1, 2)], tier="batch", chunk=0), ValueError, "chunk must be"),
        (lambda t: celery_prio.bulk(t, [(1, 2)], tier="batch", priority=3), TypeError, "does not take priority"),
        (lambda t: celery_prio.bulk(t, [(1, 2)], tier="batch", subqueue="a/b"), ValueError, "sub-queue name 'a/b'"),
        (lambda t: celery_prio.bulk(t, [(1, 2), 5], tier="batch"), TypeError, "item 1 of bulk(): args must be"),
    ],
)
def test_bad_bulk_calls_say_what_is_wrong(redis_env, call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(redis_env.app.tasks["t.add"])


@pytest.mark.slow
def test_groups_and_chunks_of_one_task_take_the_bulk_path(env):
    from celery import group

    add = env.app.tasks["t.add"]
    env.start_worker(concurrency=2)
    result = group(add.s(i, 1) for i in range(200)).apply_async()
    assert all("-" in r.id and r.id.rsplit("-", 1)[1] == str(i) for i, r in enumerate(result.results))  # bulk ids
    assert result.get(timeout=60) == [i + 1 for i in range(200)]
    chunked = add.chunks(zip(range(120), range(120), strict=True), 2).apply_async()  # 60 starmap calls
    assert chunked.results[0].id.endswith("-0")
    assert [x for part in chunked.get(timeout=60) for x in part] == [2 * i for i in range(120)]
    untiered = group(env.app.tasks["t.noop"].s() for _ in range(60)).apply_async()  # user routes decide
    assert not untiered.results[0].id.endswith("-0")
    assert untiered.get(timeout=30) == [None] * 60
    small = group(add.s(i, 1) for i in range(5)).apply_async()  # too small to gain: Celery's own path
    assert not small.results[0].id.endswith("-0")
    assert small.get(timeout=30) == [1, 2, 3, 4, 5]


def test_bulk_into_a_subqueue_honours_its_cap_and_workers_find_it(env):
    env.configure(subqueue_max_length={"batch": 30})
    sleep = env.app.tasks["t.sleep"]
    with pytest.raises(BulkQueueFull) as info:
        celery_prio.bulk(sleep, ((f"s{i}", 0) for i in range(50)), tier="batch", subqueue="bulkq", chunk=20)
    assert len(info.value.accepted) == 30
    assert info.value.waiting == 30  # the sub-queue's depth, not its tier queue's
    queue = f"{env.prefix}.batch.bulkq"
    assert env.adapter.depth(queue) == 30
    env.start_worker(concurrency=2)
    env.wait_for(lambda: env.adapter.depth(queue) == 0, timeout=30, what="the workers to drain the sub-queue")
    with pytest.raises(ValueError, match="sub-queue name"):
        celery_prio.bulk(sleep, [("x", 0)], tier="batch", subqueue="bad name")


@pytest.mark.parametrize("body_size", [0, 300, 10_000])  # none, one, and several body frames (frame_max 4096)
def test_bulk_frames_are_the_bytes_py_amqp_sends(body_size):
    """Pure: celery_prio's hand-encoded basic.publish frames against py-amqp's own frame writer."""
    import amqp
    from amqp import spec
    from amqp.method_framing import frame_writer
    from amqp.serialization import dumps

    from celery_prio.brokers.amqp.wire import PublishFrames

    class Sink:  # py-amqp's writer needs a connection's frame_max and a transport's write
        frame_max = 4096
        bytes_sent = 0

        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, data) -> None:
            self.data += bytes(data)

    properties = {"content_type": "application/json", "content_encoding": "utf-8", "delivery_mode": 2, "priority": 0}
    properties["reply_to"] = "d3b07384-d9a0-4c1f-9b1a-1c1c1c1c1c1c"
    shared = {"lang": "py", "task": "t.add", "eta": None, "retries": 0, "timelimit": [None, None], "nested": {"a": 1}}
    variable = {"id": "abc-7", "root_id": "abc-7", "argsrepr": "(7, 'é')", "prio_enqueued_at": 1.5e9, "group_index": 7}
    body = ("x" * body_size).encode()
    frames = PublishFrames(3, Sink.frame_max, "prio.batch", "prio.batch", properties, shared)
    ours = bytearray()
    frames.add(ours, body, "abc-7", variable)

    sink = Sink()
    message = amqp.Message(body, correlation_id="abc-7", application_headers={**shared, **variable}, **properties)
    args = dumps("Bssbb", (0, "prio.batch", "prio.batch", False, False))
    frame_writer(sink, sink)(1, 3, spec.Basic.Publish, args, message)
    assert bytes(ours) == bytes(sink.data)
