"""One bad message must never stop a worker (real brokers, real workers).

Malformed messages are pushed straight onto a tier queue, the way a buggy
producer in another language or a half-written migration script would. After
each one the worker must still run 20 normal tasks promptly, the bad message
must sit in ``<prefix>.dead`` with its reason (nothing dropped, nothing
redelivered into a crash loop), and the worker must go back to idle.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from celery_prio import settings_for
from celery_prio.headers import DEAD_REASON
from celery_prio.tiers import Tier

pytestmark = [pytest.mark.broker, pytest.mark.slow]

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def redis_template(env) -> dict:
    """A real task message as kombu stores it in a Redis list (taken before any worker runs)."""
    env.app.tasks["t.add"].apply_async((1, 2), tier="batch")
    return json.loads(env.adapter.client.rpop(env.queue(B)))


def redis_shapes(template: dict) -> list[tuple[str, bytes]]:
    """(what, raw element): every shape that used to stop a worker, each carrying a unique marker."""

    def variant(**changes) -> bytes:
        message = json.loads(json.dumps(template))
        message["properties"]["delivery_tag"] = str(uuid.uuid4())
        for key, value in changes.items():
            if value is ...:
                message.pop(key, None)
            else:
                message[key] = value
        message.setdefault("x-marker", str(uuid.uuid4()))
        return json.dumps(message).encode()

    def props(**changes) -> dict:
        p = {**template["properties"], "delivery_tag": str(uuid.uuid4())}
        for key, value in changes.items():
            if value is ...:
                p.pop(key, None)
            else:
                p[key] = value
        return p

    marker = lambda: uuid.uuid4().hex  # noqa: E731
    return [
        ("a JSON list", json.dumps([1, 2, marker()]).encode()),
        ("a JSON string", json.dumps(f"hello {marker()}").encode()),
        ("not JSON", f"\x80\x81 garbage {marker()}".encode("latin-1")),
        ("no properties", variant(properties=...)),
        ("no delivery_tag", variant(properties=props(delivery_tag=...))),
        ("headers a list", variant(headers=[1, 2])),
        ("headers a string", variant(headers="task=t.add")),
        ("headers null", variant(headers=None)),
        ("task name a number", variant(headers={**template["headers"], "task": 7, "id": str(uuid.uuid4())})),
        ("body not base64", variant(body="!!! not base64 !!!")),
        ("unregistered task", variant(headers={**template["headers"], "task": "t.nope", "id": str(uuid.uuid4())})),
    ]


def amqp_shapes(env) -> list[tuple[str, dict]]:
    """(what, publish kwargs) for RabbitMQ; ``runs`` tells whether it is a good task with odd headers."""
    good_body = json.dumps([[1, 2], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])

    def headers(**extra) -> dict:
        return {"task": "t.add", "id": str(uuid.uuid4()), "lang": "py", "argsrepr": "", "kwargsrepr": "", **extra}

    return [
        ("x-death a number", {"body": good_body, "headers": headers(**{"x-death": 5}), "runs": True}),
        ("x-death a string", {"body": good_body, "headers": headers(**{"x-death": "expired"}), "runs": True}),
        ("x-death a list of numbers", {"body": good_body, "headers": headers(**{"x-death": [1, 2]}), "runs": True}),
        (
            "stamp true",
            {"body": good_body, "headers": headers(prio_enqueued_at=True), "runs": True},
        ),  # RabbitMQ refuses NaN itself
        ("stamp a string", {"body": good_body, "headers": headers(prio_enqueued_at="yesterday"), "runs": True}),
        ("task name a number", {"body": good_body, "headers": headers(task=7), "runs": False}),
        ("no headers, body a list", {"body": json.dumps([1, 2]), "headers": {}, "runs": False}),
        ("no headers, body not JSON", {"body": "\x01 not json", "headers": {}, "runs": False}),
        ("unregistered task", {"body": good_body, "headers": headers(task="t.nope"), "runs": False}),
    ]


def publish_amqp(env, queue: str, body: str, headers: dict) -> str:
    import amqp

    conn = amqp.Connection("127.0.0.1:5672")
    conn.connect()
    try:
        channel = conn.channel()
        channel.basic_publish(
            amqp.Message(
                body,
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
                application_headers=headers,
            ),
            exchange="",
            routing_key=queue,
        )
    finally:
        conn.close()
    return headers.get("id", "")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


NO_BUDGET = {"max_wait": {"realtime": None}}


def assert_worker_serves(env, worker, what: str) -> None:
    """20 realtime calls back to back all answered: a burst about the size of realtime's wait budget on two
    slots (its tail may rightly be refused), so the tests that call this set no budget (``NO_BUDGET``)."""
    add = env.app.tasks["t.add"]
    started = time.monotonic()
    results = [add.apply_async((i, 1), tier="realtime") for i in range(20)]
    assert [r.get(timeout=15) for r in results] == [i + 1 for i in range(20)], what
    assert time.monotonic() - started < 15, what
    assert worker.proc.poll() is None, f"worker exited after {what}:\n{worker.log()[-3000:]}"


def keep_batch_busy(env) -> None:
    """Occupy the batch slot so the bad message is fetched from the 'a task just ended' path."""
    env.app.tasks["t.sleep"].apply_async(("busy", 0.4), tier="batch")
    env.wait_for(lambda: any(e["tag"] == "busy" for e in env.log()), timeout=10, what="the busy task to start")


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_no_malformed_message_stops_a_redis_worker(redis_env, busy):
    env = redis_env
    env.configure(**NO_BUDGET)
    template = redis_template(env)
    worker = env.start_worker(concurrency=2)
    dead_key = f"{env.prefix}.dead"
    for n, (what, raw) in enumerate(redis_shapes(template), start=1):
        if busy:
            env.recorder.delete(f"{env.prefix}:log")
            keep_batch_busy(env)
        env.adapter.client.lpush(env.queue(B), raw)
        env.wait_for(lambda n=n: env.adapter.depth(dead_key) >= n, timeout=15, what=f"{what} in the dead letters")
        assert_worker_serves(env, worker, what)

        entry = json.loads(env.adapter.client.lindex(dead_key, 0).decode("utf-8", "surrogateescape"))
        assert entry["message"].encode("utf-8", "surrogateescape") == raw, what  # kept byte for byte
        assert entry["headers"][DEAD_REASON], what
        assert entry["headers"]["prio_dead_queue"] == env.queue(B), what
    assert env.depth(B) == 0
    dead = env.adapter.dead_list(settings_for(env.app), limit=100)
    assert len(dead) == len(redis_shapes(template))
    assert all(d["reason"] for d in dead)
    assert any(d["reason"].startswith("unregistered task") for d in dead)
    # Idle again: no spinning on anything left behind.
    before, t0 = cpu_seconds(worker.pid), time.monotonic()
    time.sleep(2.0)
    assert (cpu_seconds(worker.pid) - before) / (time.monotonic() - t0) < 0.25
    # The broker-wide counter saw them.
    assert env.adapter.counters(settings_for(env.app)).get("dead_lettered:batch") == len(dead)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_no_malformed_message_stops_a_rabbitmq_worker(amqp_env, busy):
    env = amqp_env
    env.configure(**NO_BUDGET)
    worker = env.start_worker(concurrency=2)
    dead_queue = f"{env.prefix}.dead"
    expected_dead = 0
    for what, shape in amqp_shapes(env):
        if busy:
            env.recorder.delete(f"{env.prefix}:log")
            keep_batch_busy(env)
        task_id = publish_amqp(env, env.queue(B), shape["body"], shape["headers"])
        if shape["runs"]:  # a good task with odd headers: it runs, once
            assert env.app.AsyncResult(task_id).get(timeout=15) == 3, what
        else:
            expected_dead += 1
            env.wait_for(
                lambda n=expected_dead: env.adapter.depth(dead_queue) >= n, timeout=15, what=f"{what} dead-lettered"
            )
        assert_worker_serves(env, worker, what)
    time.sleep(0.5)
    assert env.depth(B) == 0
    dead = env.adapter.dead_list(settings_for(env.app), limit=100)
    assert len(dead) == expected_dead
    assert all(d["reason"] and d["queue"] == env.queue(B) for d in dead), dead
    before, t0 = cpu_seconds(worker.pid), time.monotonic()
    time.sleep(2.0)
    assert (cpu_seconds(worker.pid) - before) / (time.monotonic() - t0) < 0.25


def test_a_redelivered_bad_message_does_not_crash_loop(redis_env):
    """A malformed message that a dead worker held comes back once and goes to the dead letters."""
    env = redis_env
    env.configure(visibility_timeout=1, **NO_BUDGET)
    template = redis_template(env)
    raw = dict(template, headers=[1, 2, 3])
    raw["properties"] = {**template["properties"], "delivery_tag": str(uuid.uuid4())}
    env.adapter.client.lpush(env.queue(B), json.dumps(raw))
    worker = env.start_worker(concurrency=2)
    env.wait_for(lambda: env.adapter.depth(f"{env.prefix}.dead") == 1, timeout=15, what="the dead letter")
    time.sleep(2.5)  # past the visibility timeout: nothing comes back, the unacked record is gone
    assert env.adapter.depth(f"{env.prefix}.dead") == 1 and env.depth(B) == 0
    assert env.adapter.client.hlen(f"{env.prefix}.unacked") == 0  # this app's in-flight messages (own keys)
    assert_worker_serves(env, worker, "after the visibility timeout")


def test_rabbitmq_dead_requeue_only_addresses_this_apps_tier_queues(amqp_env):
    env = amqp_env
    elsewhere = f"{env.prefix}.elsewhere"
    dead = f"{env.prefix}.dead"
    env.app.tasks["t.noop"].apply_async(tier="realtime")  # declares the tier queues and the dead-letter queue
    with env.app.connection_for_write() as conn:
        conn.default_channel.queue_declare(queue=elsewhere, durable=False, auto_delete=False)
    body = json.dumps([[1, 2], {}, {}])
    base = {"task": "t.add", "lang": "py"}
    publish_amqp(env, dead, body, {**base, "id": "to-elsewhere", "prio_dead_queue": elsewhere})
    publish_amqp(env, dead, body, {**base, "id": "x-death-elsewhere", "x-death": [{"queue": elsewhere}]})
    publish_amqp(env, dead, body, {**base, "id": "x-death-number", "x-death": 5})
    publish_amqp(env, dead, body, {**base, "id": "good", "prio_dead_queue": env.queue(O), "prio_dead_reason": "r"})
    out = env.prio_cli("dead", "requeue")
    assert "requeued 1; 3 left" in out and "skipped 3" in out, out
    assert env.depth(O) == 1 and env.adapter.depth(elsewhere) == 0
    listed = {d["id"]: d for d in json.loads(env.prio_cli("dead", "list", "--json"))}
    assert set(listed) == {"to-elsewhere", "x-death-elsewhere", "x-death-number"}
    assert listed["x-death-number"]["queue"] is None
    env.adapter.delete_queues([elsewhere])


def test_rabbitmq_dead_requeue_takes_sub_queues_back_too(amqp_env):
    """Realtime traffic goes to shortest-first sub-queues by default: their dead letters go back there
    (declared first if they are gone: a publish to a missing queue would be dropped)."""
    env = amqp_env
    settings = settings_for(env.app)
    sjf = settings.sjf_queue("t.add")
    dead = f"{env.prefix}.dead"
    env.app.tasks["t.noop"].apply_async(tier="realtime")  # declares the tier queues and the dead-letter queue
    body = json.dumps([[1, 2], {}, {}])
    base = {"task": "t.add", "lang": "py"}
    publish_amqp(env, dead, body, {**base, "id": "rt", "prio_dead_queue": sjf, "prio_dead_reason": "r"})
    publish_amqp(env, dead, body, {**base, "id": "bad", "prio_dead_queue": f"{env.prefix}.realtime.bad/name"})
    out = env.prio_cli("dead", "requeue")
    assert "requeued 1; 1 left" in out and "skipped 1" in out, out
    assert env.adapter.depth(sjf) == 1
    env.adapter.delete_queues([sjf])
