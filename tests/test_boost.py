"""Priority inheritance at run time (issue 14): ``celery_prio.boost`` and ``celery_prio.wait``.

Real brokers and real workers. The backlog tasks sleep, so the figures are
wall-clock waits; each test counts executions from the workers' own log.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from celery import chain
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult, GroupResult

import celery_prio
from celery_prio.boost import waited_on
from celery_prio.brokers.amqp.boost import FLEET_JOINED
from celery_prio.policy.superseded import Superseded, generation_of
from celery_prio.tiers import Tier
from celery_prio.worker.control import collect_prio_stats
from tests.test_inherit import queues, tier_of


def start_worker(env, **kwargs):
    """A worker that boosts can count on: on RabbitMQ, once it joined the fleet (before its first fetch)."""
    worker = env.start_worker(**kwargs)
    if env.kind == "amqp":
        env.wait_for(lambda: FLEET_JOINED in worker.log(), timeout=20, what="the worker to join the fleet")
    return worker


def runs(env, tag: str) -> int:
    return sum(1 for x in env.log() if x["kind"] == "start" and x["tag"] == tag)


def backlog(env, n: int, seconds: float, tier: str = "offline") -> None:
    celery_prio.bulk(env.app.tasks["t.sleep"], ((f"b{i}", seconds) for i in range(n)), tier=tier)


def stale_skipped(env) -> int:
    return sum(r.get("stale_skipped", 0) for r in collect_prio_stats(env.app, timeout=1.0).values())


# -- pure --------------------------------------------------------------------------------------------------------
def test_superseded_records_say_which_copies_are_stale():
    s = Superseded(keep_for=100, max_records=3)
    s.record("a", 1, now=0)
    assert s.is_stale("a", 0) and not s.is_stale("a", 1) and not s.is_stale("b", 0)
    s.record("a", 1, now=1)  # the same boost told twice: one record
    s.record("a", 0, now=1)  # not a boost
    assert len(s) == 1
    s.retract("a", 2)  # another generation's withdrawal leaves it
    assert s.is_stale("a", 0)
    s.retract("a", 1)
    assert not s.is_stale("a", 0)
    for i in range(5):
        s.record(f"t{i}", 1, now=10 + i)
    assert len(s) == 3 and not s.is_stale("t0", 0) and s.is_stale("t4", 0)  # bounded: oldest dropped
    s.record("late", 1, now=200)
    assert [row[0] for row in s.snapshot(now=200)] == ["late"]  # older than keep_for: expired
    fresh = Superseded()
    junk = [["ok", 2, 199.0], "x", ["bad", "gen", 1.0], [3, 1, 1.0], ["ok2", 1, True], ["old", 1, -1e9]]
    assert fresh.merge(junk, now=200) == 1 and fresh.is_stale("ok", 1) and len(fresh) == 1
    # A booster whose clock is far ahead is not ignored: the journal's age is the broker's business.
    assert fresh.merge([["future", 1, 1e12], ["journal", 1, None]], now=200) == 2 and fresh.is_stale("future", 0)
    assert generation_of({"gen": 2}) == 2
    assert generation_of(None) == generation_of({"gen": True}) == generation_of({"gen": -1}) == 0


def test_a_pending_boost_holds_the_original_until_its_commit_or_its_deadline():
    from celery_prio.policy.superseded import RUN, STALE

    s = Superseded()
    s.record("a", 1, now=0, pending_for=5)
    assert s.verdict("a", 0, now=1) == 4  # the copy may not be on the broker yet: ask again in 4 s
    assert s.verdict("a", 1, now=1) == RUN  # the copy itself runs
    s.commit("a", 1, now=2)
    assert s.verdict("a", 0, now=2) == STALE
    s.record("b", 1, now=0, pending_for=5)
    assert s.verdict("b", 0, now=5) == RUN and len(s) == 1  # no commit in time: the booster died, it runs
    s.commit("c", 2, now=0)  # a commit heard without its prepare (a worker that started in between)
    assert s.verdict("c", 1, now=0) == STALE
    assert [r[0] for r in s.snapshot(now=3)] == ["a", "c"]  # peers get committed records only


def test_waited_on_walks_groups_chords_and_chains(redis_env):
    app = redis_env.app
    header = GroupResult("g", [AsyncResult("h1", app=app), AsyncResult("h2", app=app)], app=app)
    body = AsyncResult("body", parent=header, app=app)  # what chord(...).apply_async() returns
    step1 = AsyncResult("s1", app=app)
    last = AsyncResult("s2", parent=step1, app=app)  # a chain's last step
    assert {r.id for r in waited_on(body)} == {"body", "h1", "h2"}
    assert {r.id for r in waited_on(last)} == {"s1", "s2"}
    assert {r.id for r in waited_on(GroupResult("g2", [body, last], app=app))} == {"body", "h1", "h2", "s1", "s2"}


def test_bad_calls_say_what_is_wrong(redis_env):
    app = redis_env.app
    with pytest.raises(ValueError, match="valid tiers"):
        celery_prio.boost("some-id", "urgent", app=app)
    with pytest.raises(TypeError, match="AsyncResult or a task id"):
        celery_prio.boost(42, "realtime", app=app)
    with pytest.raises(ValueError, match="name the waiting tier"):
        celery_prio.wait(AsyncResult("x", app=app), timeout=0.1)


# -- real workers, both brokers ---------------------------------------------------------------------------------
def test_a_realtime_caller_waiting_on_offline_work_gets_it_in_seconds_not_the_backlog(env):
    """500 offline tasks of 100 ms ahead; the caller waits on one at the back."""
    start_worker(env, concurrency=4)
    sleep = env.app.tasks["t.sleep"]
    backlog(env, 500, 0.1)
    plain = sleep.apply_async(("plain", 0.1), tier="offline")
    target = sleep.apply_async(("target", 0.1), tier="offline")
    with pytest.raises(CeleryTimeout):
        plain.get(timeout=3)  # without inheritance: it waits behind the backlog (about 17 s on 3 slots)
    t0 = time.monotonic()
    assert celery_prio.wait(target, tier="realtime", timeout=10) == "target"
    waited = time.monotonic() - t0
    assert waited < 3.0, waited
    assert env.depth(Tier.OFFLINE) > 300  # it jumped the backlog; the backlog did not drain first
    env.wait_for(lambda: env.depth(Tier.OFFLINE) == 0 and plain.ready(), timeout=150, what="the backlog to drain")
    time.sleep(0.5)
    assert runs(env, "target") == 1 and runs(env, "plain") == 1
    if env.kind == "amqp":  # the original stayed in its queue: acked unrun when its turn came
        assert stale_skipped(env) == 1


def test_boost_of_running_finished_unknown_and_queued_tasks_says_what_happened(env):
    start_worker(env, concurrency=2)
    app = env.app
    unknown = celery_prio.boost("no-such-task", "realtime", app=app)
    assert unknown.outcome == "not_found" and unknown.detail
    running = app.tasks["t.slow_late"].apply_async(("long", 3.0))  # acks_late, offline
    env.wait_for(lambda: runs(env, "long") == 1, what="the long task to start")
    assert celery_prio.boost(running, "realtime").outcome == "running"
    assert running.get(timeout=10) == "long"
    assert celery_prio.boost(running, "realtime").outcome == "finished"
    assert runs(env, "long") == 1
    backlog(env, 2, 4.0)  # holds the one slot batch and offline may use (the other is kept for realtime)
    env.wait_for(lambda: runs(env, "b0") == 1, what="the backlog to hold the slot")
    queued = app.tasks["t.sleep"].apply_async(("queued", 0.1), tier="offline")
    first = celery_prio.boost(queued, "batch")
    assert first.outcome == "boosted" and first.from_tier is Tier.OFFLINE and first.tier is Tier.BATCH
    assert celery_prio.boost(queued, "batch").outcome == "already"  # idempotent: it waits in batch's front lane
    assert celery_prio.boost(queued, "offline").outcome == "already"
    assert celery_prio.boost(queued.id, "p0", app=app).outcome == "boosted"  # and higher again: the reserved slot
    assert queued.get(timeout=3) == "queued"
    assert celery_prio.boost(queued.id, "realtime", app=app).outcome == "finished"
    assert runs(env, "queued") == 1


def test_concurrent_boosts_of_one_task_lift_it_once(env):
    start_worker(env, concurrency=2)
    backlog(env, 100, 0.1)
    for i in range(2):  # both slots busy: the lifted task waits in the front lane while the boosts race
        env.app.tasks["t.rt_sleep"].delay(f"hold{i}", 6.0)
    env.wait_for(lambda: runs(env, "hold0") + runs(env, "hold1") == 2, what="realtime to hold both slots")
    target = env.app.tasks["t.sleep"].apply_async(("target", 0.1), tier="offline")
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def boost() -> None:
        barrier.wait()
        outcomes.append(celery_prio.boost(target, "realtime").outcome)

    threads = [threading.Thread(target=boost) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Lifted once: one boost moves it, every other one finds it lifted (or, on a box slow enough that a
    # hold ended first, already running); never a second copy.
    assert len(outcomes) == 8 and outcomes.count("boosted") == 1, outcomes
    assert set(outcomes) - {"boosted"} <= {"already", "running"}, outcomes
    assert target.get(timeout=10) == "target"
    env.wait_for(lambda: env.depth(Tier.OFFLINE) == 0, timeout=60, what="the backlog to drain")
    time.sleep(0.5)
    assert runs(env, "target") == 1


def test_a_waited_chain_runs_at_the_waiters_tier_step_after_step(env):
    """The first step is lifted; the step its worker publishes next follows it (a boosted task's children)."""
    start_worker(env, concurrency=2)
    backlog(env, 200, 0.1)
    where = env.app.tasks["t.where"]
    result = chain(where.si(tag="c1").set(tier="offline"), where.si(tag="c2").set(tier="offline")).apply_async()
    t0 = time.monotonic()
    assert celery_prio.wait(result, tier="realtime", timeout=10) == "c2"
    assert time.monotonic() - t0 < 4.0
    ran = queues(env)
    assert tier_of(env, ran["c1"]) == "realtime" and tier_of(env, ran["c2"]) == "realtime", ran


def test_wait_inside_a_running_realtime_task(env):
    """A realtime task that needs an offline result: the dependency is lifted to the waiting task's tier."""
    start_worker(env, concurrency=3)
    backlog(env, 200, 0.1)
    # The task publishes the offline dependency itself (on RabbitMQ the publishing process boosts).
    t0 = time.monotonic()
    assert env.app.tasks["t.rt_spawn_and_wait"].delay("dep", 0.1, 10).get(timeout=15) == "dep"
    assert time.monotonic() - t0 < 4.0
    if env.kind == "redis":  # any process can boost on Redis: here the dependency comes from the test process
        dependency = env.app.tasks["t.sleep"].apply_async(("dep2", 0.1), tier="offline")
        t0 = time.monotonic()
        assert env.app.tasks["t.rt_waits"].delay(dependency.id, 10).get(timeout=15) == "dep2"
        assert time.monotonic() - t0 < 4.0


def test_rabbitmq_a_worker_that_starts_after_a_boost_skips_the_stale_original(amqp_env):
    """The boost journal: the worker that saw the boost is gone; the next one still skips the original."""
    env = amqp_env
    first = start_worker(env, concurrency=2)
    backlog(env, 30, 0.1)
    target = env.app.tasks["t.sleep"].apply_async(("target", 0.1), tier="offline")
    assert celery_prio.boost(target, "realtime").outcome == "boosted"
    assert target.get(timeout=10) == "target"
    first.kill()
    second = start_worker(env, concurrency=2)
    assert "1 earlier boost(s) read" in second.log()
    env.wait_for(lambda: env.depth(Tier.OFFLINE) == 0, timeout=60, what="the backlog to drain")
    time.sleep(0.5)
    assert runs(env, "target") == 1
    assert stale_skipped(env) == 1


def test_rabbitmq_a_booster_that_dies_before_publishing_its_copy_loses_nothing(amqp_env):
    """The broadcast went out (workers were told 'pending') and the booster died before the copy's publish:
    the original is held for the commit that never comes, then runs."""
    from celery_prio.policy.superseded import PENDING_FOR

    env = amqp_env
    start_worker(env, concurrency=1)
    target = env.app.tasks["t.sleep"].apply_async(("orphan", 0.05), tier="offline")
    env.app.control.broadcast(
        "prio_supersede", arguments={"task_id": target.id, "generation": 1, "pending_for": PENDING_FOR}, reply=True
    )
    assert target.get(timeout=PENDING_FOR + 10) == "orphan"
    assert runs(env, "orphan") == 1 and stale_skipped(env) == 0


def test_rabbitmq_a_forged_journal_record_is_ignored(amqp_env):
    """Anyone on the vhost can append to the journal: a record not signed with the app's key does nothing."""
    import amqp as pyamqp

    from celery_prio import settings_for
    from celery_prio.brokers.amqp.boost import declare_journal, journal_name

    env = amqp_env
    settings = settings_for(env.app)
    target = env.app.tasks["t.sleep"].apply_async(("forged", 0.05), tier="offline")
    with env.app.connection_for_write() as conn:
        channel = conn.default_channel
        declare_journal(channel, settings)
        for sig in (None, "0" * 64):
            headers = {"id": target.id, "gen": 10**6, "phase": "commit", "at": time.time()}
            if sig:
                headers["sig"] = sig
            channel.basic_publish(
                pyamqp.Message(b"", application_headers=headers), exchange="", routing_key=journal_name(settings)
            )
    worker = start_worker(env, concurrency=1)
    assert target.get(timeout=15) == "forged"  # not skipped as stale
    assert "ignored 2 boost record(s) not signed" in worker.log()


def test_a_long_stream_is_read_to_its_end_whatever_its_length(amqp_env):
    """The timeout bounds the wait for the next record, not the whole read (20,000 records take longer
    than the 1 s given here; before, a journal past ~100k records was read only in part)."""
    import amqp as pyamqp

    from celery_prio.brokers.amqp.registry import read_to_marker

    env = amqp_env
    name = f"{env.prefix}.longstream"
    declare = lambda ch: ch.queue_declare(  # noqa: E731
        queue=name, durable=True, auto_delete=False, arguments={"x-queue-type": "stream"}
    )
    with env.app.connection_for_write() as conn:
        channel = conn.default_channel
        declare(channel)
        for i in range(20_000):
            channel.basic_publish(pyamqp.Message(b"", application_headers={"n": i}), exchange="", routing_key=name)
        seen = []
        started = time.monotonic()
        read_to_marker(conn.connection, name, declare, lambda h: seen.append(h["n"]), timeout=1.0)
        took = time.monotonic() - started
        conn.default_channel.queue_delete(name)
    assert seen == list(range(20_000)), len(seen)
    print(f"read 20,000 records in {took:.2f} s")


def test_rabbitmq_a_boost_with_no_worker_up_is_refused_and_nothing_changes(amqp_env):
    env = amqp_env
    target = env.app.tasks["t.sleep"].apply_async(("target", 0.05), tier="offline")
    outcome = celery_prio.boost(target, "realtime")
    assert outcome.outcome == "refused" and "no worker" in outcome.detail
    start_worker(env, concurrency=2)
    assert target.get(timeout=10) == "target"  # the journal's withdrawn record does not make it stale
    time.sleep(0.5)
    assert runs(env, "target") == 1


def test_boost_figures_and_the_prio_boost_command(redis_env):
    env = redis_env
    start_worker(env, concurrency=2)
    backlog(env, 50, 0.1)
    queued = env.app.tasks["t.sleep"].apply_async(("target", 0.05), tier="offline")
    out = env.prio_cli("boost", queued.id, "--tier", "realtime")
    assert out.strip() == f"{queued.id}: boosted from offline -> realtime", out
    assert queued.get(timeout=10) == "target"

    def reported() -> bool:
        reports = list(collect_prio_stats(env.app).values())
        return any(
            r["tiers"]["realtime"]["boosted_seen"] == 1 and r["tiers"]["offline"]["boosted"] == 1 for r in reports
        )

    # Seen by the worker that ran it (both brokers), and counted broker-wide out of offline (Redis).
    env.wait_for(reported, what="the worker to report the boosted task")
    status = json.loads(env.prio_cli("status", "--json"))
    assert status["tiers"]["offline"]["boosted"] == 1 and status["tiers"]["realtime"]["boosted_seen"] == 1


# -- issue 34, item 8: a boost is admitted like a publish, and its scans are bounded ---------------------------
def test_a_boost_into_a_full_tier_is_refused_and_the_task_stays(env):
    env.configure(max_length={"realtime": 3})
    queued = env.app.tasks["t.sleep"].apply_async(("queued", 0.0), tier="offline")
    for i in range(3):  # no worker: realtime holds its cap
        env.app.tasks["t.rt_sleep"].delay(f"rt{i}", 0.0)
    outcome = celery_prio.boost(queued, "realtime")
    assert outcome.outcome == "refused" and "realtime is full" in outcome.detail and "prio_max_length" in outcome.detail
    assert env.depth(Tier.OFFLINE) == 1  # still where it was


def test_the_held_look_reads_kombus_unacked_hash_a_page_at_a_time(redis_env):
    """A fleet holding thousands of messages: the look is paged (no single call reads them all), and finds one
    held at any place in the hash."""
    from celery_prio.brokers.redis.boost import HELD_PAGE
    from celery_prio.brokers.redis.scripts import BOOST_HELD
    from celery_prio.runtime import runtime_of

    booster = runtime_of(redis_env.app).publishing.booster
    client = redis_env.adapter.client
    unacked = f"{redis_env.prefix}.test-unacked"
    held = 3 * HELD_PAGE
    entries = {str(i): json.dumps([{"headers": {"id": f"task-{i}"}, "body": "x"}, "", "q"]) for i in range(held)}
    client.hset(unacked, mapping=entries)
    calls = []
    script = booster._script(client, BOOST_HELD)

    def counting(*args, **kwargs):
        calls.append(1)
        return script(*args, **kwargs)

    try:
        booster._scripts[BOOST_HELD] = counting  # the real script, its calls counted
        assert booster.held(client, f"task-{held - 1}", unacked)
        assert not booster.held(client, "task-none", unacked)
        assert len(calls) >= 3  # paged: the miss read the whole hash in several calls
    finally:
        client.delete(unacked)
