"""Aging on real Redis and RabbitMQ: lossless, exactly-once promotion."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from celery_prio.aging import plan_promotions
from celery_prio.routing import ENQUEUED_HEADER, PROMOTED_HEADER
from celery_prio.tiers import Tier

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def kombu_message(stamp: float | None, task_id: str = "x") -> bytes:
    headers = {"id": task_id, "task": "t.sleep", "timelimit": [None, None]}
    if stamp is not None:
        headers[ENQUEUED_HEADER] = stamp
    return json.dumps(
        {
            "body": "",
            "headers": headers,
            "properties": {"delivery_info": {"exchange": "p.offline", "routing_key": "p.offline"}},
        }
    ).encode()


def test_plan_promotes_only_the_due_run_at_the_oldest_end():
    now = 1000.0
    tail = [kombu_message(10, "a"), kombu_message(20, "b"), kombu_message(990, "c"), kombu_message(5, "d")]
    plan = plan_promotions(tail, O, "p.batch", threshold=60, now=now)
    assert plan.originals == tail[:2]  # "d" is due too, but sits behind a message that is not
    moved = [json.loads(m) for m in plan.rewritten]
    assert [m["headers"]["id"] for m in moved] == ["a", "b"]
    assert moved[0]["headers"][ENQUEUED_HEADER] == 10  # original stamp kept
    assert moved[0]["headers"][PROMOTED_HEADER] == ["offline"]
    assert moved[0]["properties"]["delivery_info"] == {"exchange": "p.batch", "routing_key": "p.batch"}
    assert moved[0]["headers"]["timelimit"] == [None, None]  # structure survives the rewrite
    assert plan.stamp is None


def test_plan_stamps_an_unstamped_message_on_first_sight():
    unstamped = kombu_message(None, "u")
    plan = plan_promotions([unstamped], O, "p.batch", threshold=0, now=50.0)
    assert plan.originals == []
    index, original, stamped = plan.stamp
    assert (index, original) == (0, unstamped)
    assert json.loads(stamped)["headers"][ENQUEUED_HEADER] == 50.0


def test_plan_leaves_garbage_alone():
    assert plan_promotions([b"not json"], O, "p.batch", 0, 1.0).originals == []


@pytest.mark.slow
def test_offline_tasks_age_into_batch_and_run_once_without_offline_workers(env):
    env.configure(aging={"offline": 1, "batch": 1}, aging_interval=0.2)
    sleep = env.app.tasks["t.sleep"]
    for i in range(30):
        sleep.apply_async((f"a{i}", 0), tier="offline")
    env.start_worker(concurrency=2, queues=[env.queue(R), env.queue(B)])
    done = lambda: [e["tag"] for e in env.log() if e["kind"] == "end"]  # noqa: E731
    env.wait_for(lambda: len(done()) >= 30, timeout=60, what="30 promoted tasks to run")
    time.sleep(1.0)
    assert sorted(done()) == sorted(f"a{i}" for i in range(30))  # each exactly once
    assert env.depth(O) == 0


def clone_backlog(env, n: int, stamp: float) -> set[str]:
    """n offline messages (clones of one real task message) that waited since ``stamp``."""
    sleep = env.app.tasks["t.sleep"]
    ids = {str(uuid.uuid4()) for _ in range(n)}
    if env.kind == "redis":
        sleep.apply_async(("tpl", 0), tier="offline")
        template = json.loads(env.adapter.client.rpop(env.queue(O)))
        pipe = env.adapter.client.pipeline(transaction=False)
        for task_id in ids:
            template["headers"]["id"] = task_id
            template["headers"][ENQUEUED_HEADER] = stamp
            pipe.lpush(env.queue(O), json.dumps(template))
        pipe.execute()
    else:
        import amqp

        conn = amqp.Connection("127.0.0.1:5672")
        conn.connect()
        channel = conn.channel()
        env.app.tasks["t.noop"].apply_async(tier="realtime")  # declares every tier queue and route
        for task_id in ids:
            channel.basic_publish(
                amqp.Message(
                    json.dumps([["x", 0], {}, {}]),
                    content_type="application/json",
                    content_encoding="utf-8",
                    delivery_mode=2,
                    application_headers={"id": task_id, "task": "t.sleep", ENQUEUED_HEADER: stamp},
                ),
                exchange="",
                routing_key=env.queue(O),
            )
        conn.close()
    return ids


def drain_ids(env, queue: str) -> list[str]:
    with env.app.connection_for_write() as conn:
        channel = conn.channel()
        out = []
        while (raw := channel.basic_get(queue=queue, no_ack=True)) is not None:
            out.append(channel.message_to_python(raw).headers["id"])
        return out


@pytest.mark.slow
def test_two_workers_ageing_one_backlog_promote_each_message_exactly_once(env):
    # batch never ages further here, so every promoted message stays countable in batch.
    env.configure(aging={"offline": 1, "batch": None}, aging_interval=0.05)
    ids = clone_backlog(env, 10_000, stamp=time.time())
    for _ in range(2):  # neither serves offline or batch: they only age
        env.start_worker(concurrency=1, queues=[env.queue(R)], wait=False)
    for w in env.workers:
        w.wait_ready()
    env.wait_for(lambda: env.depth(O) == 0, timeout=90, what="the offline backlog to age out")
    time.sleep(0.5)
    # RabbitMQ delivers promoted messages to the tier's ".promoted" sub-queue.
    promoted = drain_ids(env, env.queue(B) + (".promoted" if env.kind == "amqp" else ""))
    assert len(promoted) == len(set(promoted)) == 10_000
    assert set(promoted) == ids


@pytest.mark.slow
def test_worker_killed_mid_promotion_loses_nothing_and_duplicates_nothing(redis_env):
    env = redis_env
    env.configure(aging={"offline": 1, "batch": None}, aging_interval=0.01)
    ids = clone_backlog(env, 20_000, stamp=time.time() - 5)
    worker = env.start_worker(concurrency=1, queues=[env.queue(R)])
    env.wait_for(lambda: env.depth(B) > 0, timeout=30, what="promotion to start")
    worker.kill()  # SIGKILL in the middle of the passes
    in_offline, in_batch = env.depth(O), env.depth(B)
    assert in_batch > 0 and in_offline + in_batch == 20_000, (in_offline, in_batch)
    promoted, left = drain_ids(env, env.queue(B)), drain_ids(env, env.queue(O))
    assert len(set(promoted) | set(left)) == len(promoted) + len(left) == 20_000
    assert set(promoted) | set(left) == ids
