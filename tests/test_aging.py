"""Aging on real Redis and RabbitMQ: lossless, exactly-once promotion."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from celery_prio.headers import ENQUEUED_HEADER, PROMOTED_HEADER
from celery_prio.policy.aging import plan_promotions
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
            "properties": {
                "delivery_tag": f"tag-{task_id}",
                "delivery_info": {"exchange": "p.offline", "routing_key": "p.offline"},
            },
        }
    ).encode()


def test_plan_promotes_only_the_due_run_at_the_oldest_end():
    now = 1000.0
    tail = [kombu_message(10, "a"), kombu_message(20, "b"), kombu_message(990, "c"), kombu_message(5, "d")]
    plan = plan_promotions(tail, O, "p.batch.promoted", threshold=60, now=now)
    assert plan.originals == tail[:2]  # "d" is due too, but sits behind a message that is not
    moved = [json.loads(m) for m in plan.rewritten]
    assert [m["headers"]["id"] for m in moved] == ["a", "b"]
    assert moved[0]["headers"][ENQUEUED_HEADER] == 10  # original stamp kept
    assert moved[0]["headers"][PROMOTED_HEADER] == ["offline"]
    # Addressed to the promoted list itself: a restore after a crash goes there.
    assert moved[0]["properties"]["delivery_info"] == {"exchange": "", "routing_key": "p.batch.promoted"}
    assert moved[0]["headers"]["timelimit"] == [None, None]  # structure survives the rewrite
    assert plan.stamps == [] and plan.dead_heads == []


def test_plan_stamps_every_unstamped_message_of_the_window_at_once():
    window = [kombu_message(None, "u1"), kombu_message(None, "u2"), kombu_message(5, "s"), kombu_message(None, "u3")]
    plan = plan_promotions(window, O, "p.batch.promoted", threshold=0, now=50.0)
    assert plan.originals == []
    assert [(i, raw) for i, raw, _ in plan.stamps] == [(0, window[0]), (1, window[1]), (3, window[3])]
    assert all(json.loads(stamped)["headers"][ENQUEUED_HEADER] == 50.0 for _, _, stamped in plan.stamps)


@pytest.mark.parametrize(
    "stamp", [float("inf"), float("-inf"), float("nan"), True, False, "1700000000", None, [1], {"t": 1}, 1e12]
)
def test_unusable_or_future_stamps_restart_the_wait_now(stamp):
    """NaN/true/strings used to promote at once; +inf and future stamps used to block the tier for ever."""
    raw = json.loads(kombu_message(None, "x"))
    raw["headers"][ENQUEUED_HEADER] = stamp
    raw = json.dumps(raw).encode()
    due_behind = kombu_message(1.0, "due")
    plan = plan_promotions([raw, due_behind], O, "p.batch.promoted", threshold=60, now=1000.0)
    assert plan.originals == []  # not due: its wait starts now
    assert [i for i, _, _ in plan.stamps] == [0]
    assert json.loads(plan.stamps[0][2])["headers"][ENQUEUED_HEADER] == 1000.0


@pytest.mark.parametrize(
    "garbage",
    [
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b"{}",
        b'{"properties": {}}',
        b'{"properties": {"delivery_tag": "t"}, "headers": []}',
    ],
)
def test_a_head_that_is_not_a_message_is_sent_to_the_dead_letters(garbage):
    plan = plan_promotions([garbage, garbage, kombu_message(1.0, "due")], O, "p.batch.promoted", 60, 1000.0)
    assert [raw for raw, _ in plan.dead_heads] == [garbage, garbage]  # the whole run at the oldest end
    assert all(reason.startswith("malformed") for _, reason in plan.dead_heads)
    assert plan.originals == []


def test_garbage_deeper_in_the_window_ends_the_due_run_but_not_the_stamping():
    window = [kombu_message(1.0, "due"), b"garbage", kombu_message(2.0, "due2"), kombu_message(None, "u")]
    plan = plan_promotions(window, O, "p.batch.promoted", 60, 1000.0)
    assert plan.originals == window[:1]
    assert [i for i, _, _ in plan.stamps] == [3]


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
    # Both brokers deliver promoted messages to the tier's ".promoted" sub-queue.
    promoted = drain_ids(env, env.queue(B) + ".promoted")
    assert len(promoted) == len(set(promoted)) == 10_000
    assert set(promoted) == ids


@pytest.mark.slow
def test_worker_killed_mid_promotion_loses_nothing_and_duplicates_nothing(redis_env):
    env = redis_env
    env.configure(aging={"offline": 1, "batch": None}, aging_interval=0.01)
    ids = clone_backlog(env, 20_000, stamp=time.time() - 5)
    worker = env.start_worker(concurrency=1, queues=[env.queue(R)])
    promoted_queue = env.queue(B) + ".promoted"
    env.wait_for(lambda: env.adapter.depth(promoted_queue) > 0, timeout=30, what="promotion to start")
    worker.kill()  # SIGKILL in the middle of the passes
    in_offline, in_batch = env.depth(O), env.adapter.depth(promoted_queue)
    assert in_batch > 0 and in_offline + in_batch == 20_000, (in_offline, in_batch)
    promoted, left = drain_ids(env, promoted_queue), drain_ids(env, env.queue(O))
    assert len(set(promoted) | set(left)) == len(promoted) + len(left) == 20_000
    assert set(promoted) | set(left) == ids
