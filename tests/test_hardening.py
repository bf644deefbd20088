"""The newer paths under faults and in every caller state (issue 34): batched callers before finalize and in eager
mode, sub-queue re-introduction against pruning, error replies on the doorbell, an old Redis server."""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery

import celery_prio
from celery_prio.tiers import Tier
from tests.conftest import REDIS_URL, need_broker


def web_app(prefix: str, **conf: Any) -> tuple[Celery, Any]:
    """A publisher as a web app has it: the tasks module imported, no task looked up, nothing finalized."""
    app = Celery("web", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
    app.conf.update(conf)
    celery_prio.install(app, queue_prefix=prefix)

    @app.task(name="web.classify", batch=celery_prio.Batch(max_size=4), shared=False)
    def classify(calls):
        return [sum(c.args) for c in calls]

    return app, classify


def _clean(app: Celery, prefix: str) -> None:
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        for key in client.scan_iter(f"{prefix}.*"):
            client.delete(key)


def test_a_batched_task_takes_its_callers_arguments_before_the_app_is_finalized():
    """It raised ``TypeError: classify() takes 1 positional argument but 2 were given``."""
    need_broker("redis")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app, classify = web_app(prefix)
    try:
        assert not app.finalized
        result = classify.apply_async((2, 3))
        assert result.id
        assert not app.finalized  # the call did not need the app finalized
        with app.connection_for_write() as conn:
            assert conn.default_channel.client.llen(f"{prefix}.batch.sjf-web-classify") == 1
    finally:
        _clean(app, prefix)


def test_a_batched_task_called_eagerly_before_finalize_gets_a_batch_of_one():
    need_broker("redis")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app, classify = web_app(prefix, task_always_eager=True)
    try:
        assert classify.apply_async((2, 3)).get() == 5
        assert classify.delay(4, 5).get() == 9
        assert classify(1, 1) == 2  # a direct call too
    finally:
        _clean(app, prefix)


def test_a_sub_queue_in_use_is_introduced_again_well_inside_prune_after(redis_env, monkeypatch):
    """A prune pass that found a tenant's sub-queue empty for a moment took it out of the registry; its
    publishers introduced it again only after 24 h, pushing meanwhile to a queue no worker asked."""
    import time as real_time

    from celery_prio import settings_for
    from celery_prio.brokers import publishing
    from celery_prio.brokers.redis.pruning import prune

    env = redis_env
    env.configure(prune_after=60)
    settings = settings_for(env.app)
    client = env.adapter.client
    queue = f"{env.prefix}.batch.acme"
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("a", 0), tier="batch", subqueue="acme")
    assert client.sismember(settings.subqueue_registry, queue)
    client.delete(queue)  # taken by a worker: the queue is empty for a moment
    client.delete(f"{env.prefix}.prune")  # no pass ran within the lease's interval
    assert prune(client, settings, "w", now=real_time.time() + 61)["subqueues"] == 1
    assert not client.sismember(settings.subqueue_registry, queue)
    later = real_time.monotonic() + 31  # half of prio_prune_after on
    monkeypatch.setattr(publishing.time, "monotonic", lambda: later)
    sleep.apply_async(("b", 0), tier="batch", subqueue="acme")
    assert client.sismember(settings.subqueue_registry, queue)


def test_a_redis_server_older_than_supported_is_refused_naming_its_version():
    import pytest

    from celery_prio.brokers.redis.fetch import check_server_version
    from celery_prio.errors import ConfigError

    check_server_version("7.0.15")
    check_server_version("6.2.0")
    check_server_version("valkey-8")  # not a number: let it try
    with pytest.raises(ConfigError, match=r"needs Redis 6.2 or newer .*the broker runs Redis 5.0.7"):
        check_server_version("5.0.7")


def test_an_idle_worker_survives_its_redis_becoming_a_replica_and_primary_again(tmp_path):
    """``REPLICAOF`` (what a failover does to the old primary) answers the doorbell's BLPOP with an error reply;
    raised in Celery's event loop it ended the worker (``Unrecoverable error: ReadOnlyError``)."""
    import redis

    from celery_prio.tools.workers import free_port
    from tests.conftest import PrioEnv
    from tests.test_incarnation import private_redis

    port, server = private_redis(tmp_path)
    env = PrioEnv("redis", tmp_path, broker=f"redis://127.0.0.1:{port}/0")
    admin = redis.Redis(port=port)
    try:
        worker = env.start_worker(concurrency=2)
        sleep = env.app.tasks["t.sleep"]
        assert sleep.apply_async(("before", 0), tier="batch").get(timeout=15) == "before"
        import time

        time.sleep(1.5)  # idle: blocked on the doorbells
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a primary that is not there
        time.sleep(3.0)  # the waits get error replies, the fetches READONLY
        assert worker.proc.poll() is None, worker.log()[-3000:]
        admin.execute_command("REPLICAOF", "NO", "ONE")
        assert sleep.apply_async(("after", 0), tier="batch").get(timeout=15) == "after"
        log = worker.log()
        assert "Unrecoverable error" not in log
        assert "waiting on the doorbells got an error reply" in log
        assert log.count("fetch failed; retrying") <= 2, "one traceback per failure and minute, not per retry"
    finally:
        env.close()
        server.kill()
        server.wait(10)


def test_a_housekeeper_busy_with_a_long_solo_task_hands_the_fleet_jobs_over(redis_env):
    """The lease holder's heartbeat thread kept the lease while its event loop, where the fleet's jobs run, was
    held by a 40 s task under ``-P solo``: a SIGKILLed worker's acks_late task came back only when that task
    ended. Now the lease goes with the loop: the task is back within its tier's bound (10 s) plus a beat."""
    import time

    def events_of(env, tag: str, kind: str) -> list[dict]:
        return [x for x in env.log() if x["tag"] == tag and x["kind"] == kind]

    env = redis_env
    holder = env.start_worker(concurrency=1, pool="solo", queues=[env.queue(Tier.OFFLINE)])
    env.wait_for(lambda: env.adapter.client.get(f"{env.prefix}.housekeeper") is not None, what="the lease taken")
    env.app.tasks["t.sleep"].apply_async(("long", 40), tier="offline")
    env.wait_for(lambda: events_of(env, "long", "start"), what="the holder to start its long task")
    victim = env.start_worker(concurrency=1, pool="solo", queues=[env.queue(Tier.BATCH)])
    env.app.tasks["t.batch_late"].apply_async(("late", 0.5))
    time.sleep(0.2)
    env.app.tasks["t.batch_late"].apply_async(("held", 30))
    env.wait_for(lambda: events_of(env, "held", "start"), what="the victim to start its acks_late task")
    victim.kill()
    killed = time.time()
    env.start_worker(concurrency=1, pool="solo", queues=[env.queue(Tier.BATCH)])
    env.wait_for(lambda: len(events_of(env, "held", "start")) == 2, timeout=35, what="the task back")
    back = events_of(env, "held", "start")[1]["t"] - killed
    assert back < 15, f"back after {back:.1f} s: the fleet's jobs waited for the busy holder"
    assert holder.proc.poll() is None


def test_a_bulk_chunk_larger_than_luas_unpack_limit_is_pushed_whole(redis_env):
    """``bulk_push.lua`` passed every message to one ``unpack``, which fails beyond about 8,000 values."""
    from celery_prio.brokers.redis.scripts import BULK_PUSH

    env = redis_env
    client = env.adapter.client
    queue, n = env.queue(Tier.BATCH), 20_000
    push = client.register_script(BULK_PUSH)
    keys = [queue, f"{env.prefix}.dead", f"{env.prefix}.stats", f"{env.prefix}.bell.batch"]
    accepted, depth = push(keys=keys, args=[-1, "reject", "batch", 0, *(f"m{i}" for i in range(n))])
    assert (accepted, depth) == (n, n) and client.llen(queue) == n
    assert client.lindex(queue, -1) == b"m0" and client.lindex(queue, 0) == f"m{n - 1}".encode()  # order kept


def test_an_idle_rabbitmq_worker_whose_slots_fill_without_a_fetch_holds_nothing_pushed(amqp_env):
    """Item 9: a worker waits on consumers while idle; its only slot then fills without a fetch (a task whose
    countdown came). A message pushed meanwhile goes back at once, for another worker to run, instead of
    waiting in this one's hand for the length of its task."""
    env = amqp_env
    env.start_worker(concurrency=1)
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("eta", 6.0), countdown=1.0, tier="batch")  # fetched now, runs in a second: no fetch then
    env.wait_for(lambda: any(x["tag"] == "eta" for x in env.log()), what="the countdown task to start")
    time.sleep(0.3)  # the worker is busy; had it kept its idle consumers, the next push would stay in its hand
    pushed = sleep.apply_async(("pushed", 0.0), tier="batch")
    time.sleep(0.5)
    env.start_worker(concurrency=1)  # a second worker, free: it runs the message at once
    assert pushed.get(timeout=4.0) == "pushed"  # not after the first worker's 6 s task


def test_a_stale_copy_check_reads_the_slices_journal_from_the_tasks_first_publish_only(amqp_env):
    """Item 9: a sliced task given back (or aged through a dead-letter exchange) checks the journal for a newer
    continuation. It reads what was appended since the task was first published, not the whole stream (up to
    64 MB: a read that outlived its timeout failed the task)."""
    import amqp as pyamqp

    from celery_prio import settings_for
    from celery_prio.brokers.amqp.continuations import declare_journal, journal_name
    from celery_prio.brokers.amqp.registry import read_to_marker

    settings = settings_for(amqp_env.app)
    with amqp_env.app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=3)
        channel = conn.connection.channel()
        declare_journal(channel, settings)
        for i in range(3000):  # other tasks' continuations, long before this task was published
            headers = {"slice": f"other-{i}", "gen": 1}
            channel.basic_publish(pyamqp.Message(b"", application_headers=headers), routing_key=journal_name(settings))
        time.sleep(2.0)
        first_published = time.time()
        time.sleep(0.5)
        channel.basic_publish(
            pyamqp.Message(b"", application_headers={"slice": "mine", "gen": 2}),
            routing_key=journal_name(settings),
        )
        seen: list[dict] = []
        read = read_to_marker(
            conn.connection, journal_name(settings), lambda ch: declare_journal(ch, settings), seen.append, 10.0,
            since=first_published,
        )  # fmt: skip
        assert any(h.get("slice") == "mine" for h in seen)
        assert read < 100, read  # not the 3,000 records before it
        everything = read_to_marker(
            conn.connection, journal_name(settings), lambda ch: declare_journal(ch, settings), lambda h: None, 10.0
        )
        assert everything >= 3001


def test_a_busy_worker_survives_a_failover_and_its_refused_ack_runs_nothing_twice(tmp_path):
    """A task ends while Redis refuses writes (``REPLICAOF``, as a failover does): its ack raised ``ReadOnlyError``
    in Celery's event loop, which ended the worker. Now the consumer reconnects as for a lost connection, and
    the ack is settled once Redis takes writes again: the task does not run twice."""
    import redis

    from celery_prio.tools.workers import free_port
    from tests.conftest import PrioEnv
    from tests.test_incarnation import private_redis

    port, server = private_redis(tmp_path)
    env = PrioEnv("redis", tmp_path, broker=f"redis://127.0.0.1:{port}/0")
    admin = redis.Redis(port=port)
    try:
        worker = env.start_worker(concurrency=2)
        late = env.app.tasks["t.batch_late"]  # acks_late
        running = late.apply_async(("during", 1.5), tier="batch")
        env.wait_for(lambda: any(x["tag"] == "during" for x in env.log()), what="the task to start")
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # its end and ack fall in here
        time.sleep(2.5)
        assert worker.proc.poll() is None, worker.log()[-3000:]
        admin.execute_command("REPLICAOF", "NO", "ONE")
        assert running.get(timeout=20) == "during"
        assert late.apply_async(("after", 0), tier="batch").get(timeout=20) == "after"
        time.sleep(1.0)  # the refused ack is settled at the reconnect or the next fetch
        starts = [x["tag"] for x in env.log() if x["kind"] == "start"]
        assert starts.count("during") == 1, starts
        assert "Unrecoverable error" not in worker.log()
        import celery

        if celery.VERSION >= (5, 7):  # Celery 5.5 drops the ack of a task that ends while its consumer restarts:
            assert admin.hlen(f"{env.prefix}.unacked") == 0  # its message stays owned until the worker restarts
    finally:
        env.close()
        server.kill()
        server.wait(10)


def test_a_solo_worker_acks_each_task_before_it_runs_the_next(redis_env):
    """``-P solo`` runs tasks on the event loop's thread. Celery queues an ``acks_late`` ack on that loop, in
    no set order with the fetch loop's refill: a task's ack could wait for the next task to end. A worker
    killed during a long next task then ran the finished one again."""
    env = redis_env
    worker = env.start_worker(concurrency=1, pool="solo")
    late = env.app.tasks["t.batch_late"]  # acks_late
    shorts = [late.apply_async((f"short{i}", 0.01), tier="batch") for i in range(6)]
    late.apply_async(("long", 30.0), tier="batch")
    for r in shorts:
        assert r.get(timeout=20).startswith("short")
    env.wait_for(lambda: any(x["tag"] == "long" for x in env.log()), what="the long task to start")
    time.sleep(0.5)
    worker.kill()  # SIGKILL during the long task
    env.start_worker(concurrency=1)
    env.wait_for(lambda: [x["tag"] for x in env.log()].count("long") >= 2, timeout=30, what="the long task again")
    starts = [x["tag"] for x in env.log() if x["kind"] == "start"]
    assert all(starts.count(f"short{i}") == 1 for i in range(6)), starts
