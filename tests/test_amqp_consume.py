"""``prio_fetch="consume"``: RabbitMQ pushes the tier queues to the worker (``brokers/amqp/consume.py``).

The source on a real broker first: what it holds, when it gives back, and
when a queue's next message comes. Then the worker scenarios of
``test_worker.py`` again with real workers fetching by push.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_prio import settings_for
from celery_prio.brokers.amqp.consume import AmqpConsumeSource
from celery_prio.brokers.amqp.idle_reports import IDLE_REPORT_INTERVAL, IdleReports, report_interval
from celery_prio.errors import ConfigError
from celery_prio.policy.served import ServedQueues
from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS, Tier
from tests import test_worker

pytestmark = pytest.mark.broker

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE
ORDER = [R, B, O]


@contextmanager
def push_source(env, free: int = 1, **settings):
    """A consume-mode source on its own connection, with ``free`` slots free (as the fetch loop tells it)."""
    env.configure(sjf=False, fetch="consume", **settings)
    conn = env.app.connection_for_write()
    try:
        prio = settings_for(env.app)
        served = ServedQueues(prio, [prio.queue_name(t) for t in TIERS])
        source = AmqpConsumeSource(env.app, conn.channel(), served, prio)
        source.free_slots = lambda: free
        gets: list[list[str]] = []
        real_get_many = source.get_many
        source.get_many = lambda queues: gets.append(list(queues)) or real_get_many(queues)  # count basic_gets
        source.gets = gets
        yield source, conn
    finally:
        conn.release()


def pump_until(conn, predicate, timeout: float = 5.0) -> None:
    """Read what RabbitMQ pushes (the worker's event loop does this) until ``predicate()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a push"
        try:
            conn.drain_events(timeout=0.05)
        except TimeoutError:
            pass


def settle(conn, seconds: float) -> None:
    """Read pushes for ``seconds`` (to see that nothing more comes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.05)
        except TimeoutError:
            pass


def test_pushed_messages_are_taken_in_tier_order_without_a_broker_call(amqp_env):
    env = amqp_env
    with push_source(env) as (source, conn):
        assert source.take(ORDER).message is None  # starts one consumer per tier queue and front lane
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("b", 0), tier="batch")
        sleep.apply_async(("o", 0), tier="offline")
        sleep.apply_async(("r", 0), tier="realtime")
        pump_until(conn, lambda: source.held == 3)  # all three pushed into the hand
        taken = []
        for _ in range(3):
            # Past the window in which a queue just taken from may still be pushed its next message
            # (within it, a queue ahead of the one in hand is asked by basic_get, to keep the order).
            time.sleep(settings_for(env.app).poll_interval * 1.2)
            take = source.take(ORDER)
            taken.append((take.tier, take.message.payload[0][0]))
            take.message.ack()
        assert taken == [(R, "r"), (B, "b"), (O, "o")]
        assert source.gets == []  # tier queues and front lanes are pushed: no basic_get at all
        assert source.take(ORDER).message is None


def test_a_queue_whose_next_message_may_be_coming_is_asked_before_a_lower_tier_in_hand(amqp_env):
    """Right after a take, realtime's next message may still be on its way: asked, not skipped for offline."""
    env = amqp_env
    with push_source(env, free=2) as (source, conn):
        source.take(ORDER)
        time.sleep(settings_for(env.app).poll_interval * 1.2)  # consumers started longer ago than the window
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("r0", 0), tier="realtime")
        sleep.apply_async(("o", 0), tier="offline")
        pump_until(conn, lambda: source.held == 2)
        first = source.take(ORDER)  # realtime's consumer now waits for this one's ack
        sleep.apply_async(("r1", 0), tier="realtime")  # not pushed until r0 is acked
        realtime = settings_for(env.app).queue_name(R)
        while env.adapter.depth(realtime) == 0:  # routed (a few ms: well inside the window)
            time.sleep(0.002)
        source.gets.clear()
        second = source.take(ORDER)
        assert [first.message.payload[0][0], second.message.payload[0][0]] == ["r0", "r1"]
        assert source.gets == [[realtime]]  # one basic_get, and offline's message stays in hand
        assert source.held == 1
        first.message.ack()
        second.message.ack()


def test_a_get_that_finds_a_queue_empty_after_its_last_message_was_settled_closes_its_window(amqp_env):
    """While realtime's last message is unsettled its next may still be pushed, so a take with a lower tier in
    hand asks realtime by ``basic_get`` (every time: an empty answer then proves nothing). Once that message is
    settled, one empty answer proves nothing is on its way (RabbitMQ handles a channel's methods in order): the
    takes after it do not ask realtime again (a realtime trickle cost a busy worker a round trip per task)."""
    env = amqp_env
    with push_source(env, free=3, poll_interval=1.0) as (source, conn):
        source.take(ORDER)
        time.sleep(1.2)  # consumers started longer ago than the window
        sleep = env.app.tasks["t.sleep"]
        for label, tier in (("r0", "realtime"), ("b0", "batch"), ("o0", "offline")):
            sleep.apply_async((label, 0), tier=tier)
        pump_until(conn, lambda: source.held == 3)
        realtime = settings_for(env.app).queue_name(R)
        first = source.take(ORDER)  # r0: realtime's consumer waits for its ack, its next may come then
        assert first.message.payload[0][0] == "r0"
        source.gets.clear()
        second = source.take(ORDER)
        assert second.message.payload[0][0] == "b0" and [realtime] in source.gets  # asked: r0 is unsettled
        first.message.ack()
        source.gets.clear()
        third = source.take(ORDER)  # asked once more, after the settle: its empty answer is the proof
        assert third.message.payload[0][0] == "o0" and any(realtime in asked for asked in source.gets)
        sleep.apply_async(("o1", 0), tier="offline")
        third.message.ack()  # offline's consumer is pushed o1
        pump_until(conn, lambda: source.held == 1)
        source.gets.clear()
        fourth = source.take(ORDER)
        assert fourth.message.payload[0][0] == "o1"
        assert not any(realtime in asked for asked in source.gets), source.gets  # nothing on its way: not asked
        second.message.ack()
        fourth.message.ack()


def first_of_batch(env, source, conn, task: str, n: int):
    """Publish ``n`` batch calls of ``task``; take the first once it is pushed (one slot free)."""
    source.take(ORDER)
    for i in range(n):
        env.app.tasks[task].apply_async((f"b{i}", 0), tier="batch")
    pump_until(conn, lambda: source.held == 1)
    assert env.depth(B) == n - 1  # one in hand, the rest in the queue
    return source.take(ORDER).message


def test_a_queue_holds_one_message_until_celery_acks_the_last(amqp_env):
    """Prefetch 1 per consumer: with one slot free, the next message is pushed only once the last is acked."""
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        first = first_of_batch(env, source, conn, "t.sleep", 5)
        settle(conn, 0.3)
        assert env.depth(B) == 4  # unacked: its consumer gets nothing more
        first.ack()
        pump_until(conn, lambda: source.held == 1)  # acked: the next one is pushed
        assert env.depth(B) == 3
        second = source.take(ORDER)
        assert second.message.payload[0][0] == "b1"
        second.message.ack()


def test_a_task_acked_late_does_not_hold_its_queue(amqp_env):
    """An ``acks_late`` task stays unacked while it runs: its consumer is replaced, the queue goes on."""
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        first = first_of_batch(env, source, conn, "t.batch_late", 3)
        pump_until(conn, lambda: source.held == 1)  # the next one comes although the first is unacked
        assert env.depth(B) == 1
        second = source.take(ORDER).message
        assert [first.payload[0][0], second.payload[0][0]] == ["b0", "b1"]
        first.ack()
        second.ack()


def test_free_slots_set_how_many_messages_come(amqp_env):
    env = amqp_env
    with push_source(env, free=4) as (source, conn):
        source.take(ORDER)
        sleep = env.app.tasks["t.sleep"]
        for i in range(20):
            sleep.apply_async((f"b{i}", 0), tier="batch")
        pump_until(conn, lambda: source.held == 1)
        source.take(ORDER).message.ack()  # 3 slots still free: 3 consumers out now
        pump_until(conn, lambda: source.held == 3)
        settle(conn, 0.3)
        assert source.held == 3 and env.depth(B) == 16  # one per free slot, no more
        source.free_slots = lambda: 1  # the other two slots were taken meanwhile (by another tier, say)
        for _ in range(3):
            source.take(ORDER).message.ack()
        settle(conn, 0.3)
        assert source.held == 1 and env.depth(B) == 15  # back to one consumer: at most one in hand


def test_short_tasks_keep_a_message_coming_for_each_start_expected_within_hold_max(amqp_env):
    """Capacity in time: with short measured tasks a queue holds what the slots will start within
    ``prio_hold_max`` (Celery's prefetch at most), so a drain keeps its consumers instead of one per task."""
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        source.slots = 2  # Celery's prefetch: 2 slots x worker_prefetch_multiplier 4
        expected = {"starts": 6}
        source.starts_within = lambda seconds, tier: expected["starts"]
        source.take(ORDER)
        sleep = env.app.tasks["t.sleep"]
        for i in range(30):
            sleep.apply_async((f"b{i}", 0), tier="batch")
        pump_until(conn, lambda: source.held == 1)
        source.take(ORDER).message.ack()  # 6 starts expected: this one and 5 more in hand
        pump_until(conn, lambda: source.held == 5)
        settle(conn, 0.3)
        assert source.held == 5
        expected["starts"] = 50  # more than Celery's own prefetch: capped at 8
        consumers = next(source._tags)
        for _ in range(2):
            source.take(ORDER).message.ack()
        pump_until(conn, lambda: source.held == 7)
        settle(conn, 0.3)
        assert source.held == 7 and env.depth(B) == 30 - 3 - 7
        assert next(source._tags) - consumers <= 4  # consumers added, none cancelled and started per task
        for _ in range(7):
            source.take(ORDER).message.ack()


def test_a_message_held_past_hold_max_goes_back_for_another_worker(amqp_env):
    env = amqp_env
    with push_source(env, free=0, hold_max=0.2) as (source, conn):
        source.take([])  # consumers out; no slot free, so the scheduler asks for nothing
        env.app.tasks["t.sleep"].apply_async(("b", 0), tier="batch")
        pump_until(conn, lambda: source.held == 1)  # pushed into the hand
        source.give_back_stale()
        assert env.depth(B) == 0  # not yet past hold_max: still held
        time.sleep(0.25)
        source.give_back_stale()
        pump_until(conn, lambda: env.depth(B) == 1)  # back in the queue, where any worker can take it
        settle(conn, 0.3)
        assert env.depth(B) == 1  # and its consumer is gone: it is not pushed again at once
        source.free_slots = lambda: 1
        assert source.take(ORDER).message is None  # a slot asks for batch: its consumer starts again
        pump_until(conn, lambda: source.held == 1)
        take = source.take(ORDER)
        assert take.message.payload[0][0] == "b" and take.message.delivery_info["redelivered"]
        take.message.ack()


def test_a_realtime_message_given_back_is_taken_before_a_lower_tier_in_hand_when_a_slot_asks(amqp_env):
    """A take that starts a parked queue's consumer again asks the queue in the same round trip; RabbitMQ pushes
    the message to the new consumer and answers the get empty, the push a moment after. Without waiting for it,
    the offline message in hand took the slot (on a ``-c 1`` sliced worker, the slot a run yielded for realtime),
    and the realtime message was held until ``prio_hold_max`` and given back again."""
    env = amqp_env
    with push_source(env, free=0, hold_max=0.2) as (source, conn):
        source.take([])  # consumers out; no slot free
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("r", 0), tier="realtime")
        pump_until(conn, lambda: source.held == 1)
        time.sleep(0.25)
        source.give_back_stale()  # held past hold_max: back to its queue, whose consumer is cancelled (parked)
        pump_until(conn, lambda: env.depth(R) == 1)
        sleep.apply_async(("o", 0), tier="offline")
        pump_until(conn, lambda: source.held == 1)  # offline's message in hand
        source.free_slots = lambda: 1
        take = source.take(ORDER)
        assert (take.tier, take.message.payload[0][0]) == (R, "r")
        take.message.ack()
        assert source.held == 1  # offline's, still in hand for the next slot


def test_stop_gives_back_what_it_holds(amqp_env):
    env = amqp_env
    with push_source(env, free=2) as (source, conn):
        source.take(ORDER)
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("r", 0), tier="realtime")
        sleep.apply_async(("b", 0), tier="batch")
        pump_until(conn, lambda: source.held == 2)
        source.stop()
        assert source.held == 0
        pump_until(conn, lambda: env.depth(R) == 1 and env.depth(B) == 1)
        settle(conn, 0.2)
        assert env.depth(R) == 1 and env.depth(B) == 1  # no consumer left to push them again


def test_sub_queues_are_pushed_too_and_taken_in_tier_order(amqp_env):
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        prio = settings_for(env.app)
        sub = prio.subqueue_name(B, "acme")
        source.prepare_subqueues([sub])
        source.served.set_discovered([sub])
        assert source.take(ORDER).message is None
        assert sub in source.pushed  # a declared sub-queue is pushed: no basic_get per fetch for it
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("o", 0), tier="offline")
        sleep.apply_async(("acme", 0), tier="batch", subqueue="acme")
        pump_until(conn, lambda: source.held == 2)
        time.sleep(2 * prio.poll_interval)  # past the window in which a new consumer's queue counts as pending
        calls = source.broker_calls
        take = source.take(ORDER)
        assert (take.tier, take.queue, take.message.payload[0][0]) == (B, sub, "acme")  # batch before offline
        take.message.ack()
        take = source.take(ORDER)
        assert (take.tier, take.message.payload[0][0]) == (O, "o")
        take.message.ack()
        # Both from the hand; at most batch's queue asked once (its next message may have been on its way).
        assert source.broker_calls <= calls + 1


def test_a_take_orders_only_the_pushed_queues_that_may_have_a_message(amqp_env):
    """200 tenants pushed, one with work: a take orders that one (and the tier's own queue, its next message
    perhaps on its way), not the 200, and reports the idle ones empty now and then, not on every take."""
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        prio = settings_for(env.app)
        subs = [prio.subqueue_name(B, f"t{i}") for i in range(200)]
        source.prepare_subqueues(subs)
        source.served.set_discovered(subs)
        assert source.take(ORDER).message is None
        sleep = env.app.tasks["t.sleep"]
        for i in range(3):
            sleep.apply_async((f"w{i}", 0), tier="batch", subqueue="t7")
        pump_until(conn, lambda: source.held == 1)
        time.sleep(2 * prio.poll_interval)  # past the window in which a new consumer's queue counts as pending
        ordered: list[int] = []
        real_order = source.served.asking_order
        source.served.asking_order = lambda tier, active: (  # type: ignore[method-assign]
            ordered.append(len(active)) or real_order(tier, active)
        )
        reports = []
        for i in range(3):
            take = source.take(ORDER)
            assert take.message.payload[0][0] == f"w{i}"
            reports.append(len(take.empty_queues))
            take.message.ack()
            if i < 2:
                pump_until(conn, lambda: source.held == 1)
        assert ordered and max(ordered) <= 3, ordered  # t7 (and perhaps the tier queue), never the 200
        assert reports[0] >= 199 and max(reports[1:]) < 10, reports  # the idle tenants: once, not every take


def test_pushes_to_another_tier_leave_an_empty_answer_standing(amqp_env):
    """A slot kept for realtime asks realtime once per task of a batch drain: batch messages pushed meanwhile
    do not make that ask look at realtime's queues again, and a realtime push does (it is taken at once)."""
    env = amqp_env
    with push_source(env, free=1) as (source, conn):
        prio = settings_for(env.app)
        assert source.take(ORDER).message is None  # consumers started
        time.sleep(prio.poll_interval * 1.2)  # past the window in which a new consumer's queue counts as pending
        assert source.take([R]).message is None
        sleep = env.app.tasks["t.sleep"]
        for i in range(2):
            sleep.apply_async((f"b{i}", 0), tier="batch")
        pump_until(conn, lambda: source.held == 1)  # one slot free: one batch message in hand
        looked: list[Tier] = []
        real_split = source._split
        source._split = lambda tier, now: looked.append(tier) or real_split(tier, now)  # type: ignore[method-assign]
        assert source.take([R]).message is None
        assert looked == []  # the kept answer: realtime's queues not looked at again
        batch = source.take([B])
        assert batch.message.payload[0][0] == "b0"
        batch.message.ack()
        assert source.take([R]).message is None and looked == [B]
        assert source.wait_for_work([R])  # the loop then waits for the next push, as after a full look
        sleep.apply_async(("r", 0), tier="realtime")
        pump_until(conn, lambda: source.held_by_tier().get(R) == 1)
        realtime = source.take([R])
        assert realtime.message.payload[0][0] == "r" and R in looked
        realtime.message.ack()


def test_a_standing_empty_answer_reports_its_queues_at_the_idle_pace_not_on_every_ask(amqp_env):
    """The kept answer is not a full look, but the scheduler still hears that realtime's queues stay empty:
    each at most every ``IDLE_REPORT_INTERVAL``, and again once that has passed (never silenced for good)."""
    env = amqp_env
    with push_source(env, free=1) as (source, _conn):
        prio = settings_for(env.app)
        assert source.take(ORDER).message is None  # consumers started
        time.sleep(prio.poll_interval * 1.2)  # past the window in which a new consumer's queue counts as pending
        first = source.take([R])  # a full look: realtime's queues found empty and reported
        assert first.message is None and first.empty_queues
        looked: list[Tier] = []
        real_split = source._split
        source._split = lambda tier, now: looked.append(tier) or real_split(tier, now)  # type: ignore[method-assign]
        again = source.take([R])
        assert again.message is None and again.empty == first.empty and again.empty_queues == ()  # none due yet
        time.sleep(IDLE_REPORT_INTERVAL * 1.5)
        due = source.take([R])
        assert set(due.empty_queues) == set(first.empty_queues)  # each due again, reported again
        assert source.take([R]).empty_queues == ()
        assert looked == []  # all from the kept answer: no queue looked at


def test_idle_reports_pace_each_pushed_queue_and_slow_down_for_many():
    reports, pushed = IdleReports(), {"a", "b"}
    assert reports.due(("a", "b", "got"), pushed, 10.0) == ("a", "b", "got")
    assert reports.due(("a", "b", "got"), pushed, 10.01) == ("got",)  # asked by basic_get: every time
    assert reports.next_due(("a", "b"), 10.01) == pytest.approx(10.0 + IDLE_REPORT_INTERVAL)
    reports.busy("a")  # it had work: reported at once when next found empty
    assert reports.due(("a", "b"), pushed, 10.02) == ("a",)
    many = tuple(f"q{i}" for i in range(500))
    assert reports.due(many, set(many), 20.0) == many
    assert reports.due(many, set(many), 21.0) == ()  # 500 at once: each every 2 s
    assert reports.due(many, set(many), 22.0) == many
    # The same queues asked again before any is due: none, and one that had work in between is reported at once.
    assert reports.due(("a", "b"), pushed, 30.0) == ("a", "b")
    assert reports.due(("a", "b"), pushed, 30.01) == ()
    reports.busy("b")
    assert reports.due(("a", "b"), pushed, 30.02) == ("b",)
    assert reports.due(("a", "b"), pushed, 30.0 + IDLE_REPORT_INTERVAL) == ("a",)


def test_idle_reports_next_due_is_when_the_first_reported_is_due_again():
    """``next_due`` answers from what ``due`` worked out for the same queues: checked against the report
    times ``due`` returned, over random asks, gaps and queues that had work in between."""
    rng, reports, names = random.Random(37), IdleReports(), ("a", "b", "c")
    reported_at: dict[str, float] = {}
    now = 100.0
    for _ in range(3000):
        now += rng.choice((0.0, 0.001, 0.01, 0.03, IDLE_REPORT_INTERVAL, 0.07))
        if rng.random() < 0.1:
            name = rng.choice(names)
            reports.busy(name)
            reported_at.pop(name, None)
        queues = tuple(n for n in names if rng.random() < 0.7) or names
        for name in reports.due(queues, set(names), now):
            reported_at[name] = now
        expected = min(reported_at.get(n, now) for n in queues) + report_interval(queues)
        assert reports.next_due(queues, now) == pytest.approx(expected)


def test_consume_mode_refuses_quorum_queues_and_bad_values():
    with pytest.raises(ConfigError, match=r"prio_fetch='consume' needs classic queues"):
        load_settings({"prio_fetch": "consume", "prio_queue_type": "quorum"})
    with pytest.raises(ConfigError, match=r"prio_fetch must be one of \('get', 'consume'\), got 'push'"):
        load_settings({"prio_fetch": "push"})
    with pytest.raises(ConfigError, match=r"prio_hold_max must be a number > 0"):
        load_settings({"prio_hold_max": 0})
    assert load_settings({}).fetch == "consume"  # push by default on classic queues
    assert load_settings({"prio_queue_type": "quorum"}).fetch == "get"  # a give-back would count on quorum queues


# -- real workers fetching by push: the scenarios of test_worker.py ------------------------------------------
WORKER_SCENARIOS = [
    test_worker.test_backlogged_tiers_share_slot_time_by_weight,
    test_worker.test_realtime_starts_promptly_while_long_offline_tasks_fill_the_worker,
    test_worker.test_eta_retry_and_chord_across_tiers,
    test_worker.test_sigkill_mid_task_with_acks_late_loses_nothing,
    test_worker.test_warm_shutdown_finishes_running_tasks_and_leaves_the_rest_queued,
    test_worker.test_worker_with_q_serves_only_its_tier_and_queues_can_be_added,
    test_worker.test_bad_messages_are_rejected_and_the_worker_keeps_serving,
    test_worker.test_inspect_stats_show_per_tier_dispatch_counts,
    test_worker.test_idle_worker_makes_bounded_broker_calls,
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", WORKER_SCENARIOS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_worker_scenarios_fetching_by_push(scenario, amqp_push_env):
    scenario(amqp_push_env)


def busy_worker_and_next(env, hold_max: float, long_seconds: float) -> None:
    """One worker of one slot runs a long batch task; then a short one ("next") is published behind it."""
    env.configure(hold_max=hold_max, reserve=0)
    env.start_worker(concurrency=1)
    env.app.tasks["t.sleep"].apply_async(("long", long_seconds), tier="batch")
    env.wait_for(lambda: test_worker.starts(env, "long"), what="the long task to start")
    env.app.tasks["t.sleep"].apply_async(("next", 0.0), tier="batch")


@pytest.mark.slow
def test_a_busy_worker_gives_back_what_another_worker_can_run(amqp_push_env):
    """One worker busy with a long task holds the next one for at most hold_max; an idle one then runs it."""
    env = amqp_push_env
    busy_worker_and_next(env, hold_max=0.2, long_seconds=6.0)
    env.start_worker(concurrency=1)  # idle: can run "next" at once, if the first worker lets go of it
    env.wait_for(lambda: test_worker.starts(env, "next"), timeout=4, what="the second worker to run 'next'")
    assert not [e for e in env.log() if e["tag"] == "long" and e["kind"] == "end"]  # the first is still busy


@pytest.mark.slow
def test_a_busy_worker_reports_what_it_holds(amqp_push_env):
    """With a long hold_max the next task stays in hand (reported) until the slot frees: the give-back is what
    lets the idle worker of the test above run it."""
    from celery_prio.worker.control import collect_prio_stats

    env = amqp_push_env
    busy_worker_and_next(env, hold_max=30, long_seconds=3.0)

    def held() -> int:
        (prio,) = collect_prio_stats(env.app, timeout=5, limit=1).values()
        return prio["held"]

    env.wait_for(lambda: held() == 1, timeout=2, what="the worker to report 'next' in hand")
    assert env.depth(B) == 0 and not test_worker.starts(env, "next")
    env.wait_for(lambda: test_worker.starts(env, "next"), timeout=10, what="'next' to run once the slot frees")


def _local_ports(pid: int) -> set[int]:
    """TCP ports of the sockets process ``pid`` holds (from /proc: no extra dependency)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_a_worker_that_loses_its_connection_fetches_by_push_again(amqp_push_env):
    """RabbitMQ closes the worker's connections (a network blip): it reconnects and its consumers start again."""
    env = amqp_push_env
    worker = env.start_worker(concurrency=2)
    t = env.app.tasks
    for i in range(3):
        t["t.sleep"].apply_async((f"a{i}", 0.0), tier="batch")
    env.wait_for(lambda: len(test_worker.starts(env, "a")) == 3, what="the first three tasks")
    ports = _local_ports(worker.pid)
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "peer_port"], capture_output=True, text=True, check=True
    ).stdout
    closed = 0
    for line in listing.splitlines():
        pid, _, port = line.rpartition("\t")
        if port.isdigit() and int(port) in ports:
            subprocess.run(["rabbitmqctl", "close_connection", pid, "test: connection lost"], capture_output=True)
            closed += 1
    assert closed, (listing, ports)
    env.wait_for(lambda: "Connection to broker lost" in worker.log(), what="the worker to see it")
    for i in range(3):
        t["t.sleep"].apply_async((f"b{i}", 0.0), tier="batch")
    t["t.rt_sleep"].delay("rt", 0.0)
    env.wait_for(
        lambda: len(test_worker.starts(env, "b")) == 3 and test_worker.starts(env, "rt"),
        timeout=30,
        what="the tasks published after the reconnect",
    )
    assert worker.proc.poll() is None


@pytest.mark.slow
def test_the_default_sigkilled_with_messages_in_hand_loses_none_and_runs_none_twice(amqp_env):
    """The default fetch (push) on a worker SIGKILLed while it holds pushed messages it has not started: RabbitMQ
    requeues them the moment the connection closes, another worker runs each once; the task that was running
    (acked as it started, Celery's default) is not run again."""
    from celery_prio.worker.control import collect_prio_stats

    env = amqp_env
    assert settings_for(env.app).fetch == "consume"
    busy_worker_and_next(env, hold_max=30, long_seconds=30.0)  # "next" stays in hand behind the long task
    env.app.tasks["t.sleep"].apply_async(("later", 0.0), tier="offline")

    def held() -> int:
        (prio,) = collect_prio_stats(env.app, timeout=5, limit=1).values()
        return prio["held"]

    env.wait_for(lambda: held() == 2, timeout=5, what="the worker to hold 'next' and 'later'")
    assert env.depth(B) == env.depth(O) == 0
    env.workers[0].kill()
    env.wait_for(lambda: env.depth(B) == 1 and env.depth(O) == 1, timeout=2, what="the held messages back at once")
    env.start_worker(concurrency=1)
    env.wait_for(lambda: test_worker.starts(env, "next") and test_worker.starts(env, "later"), timeout=20)
    time.sleep(1)
    tags = [e["tag"] for e in env.log() if e["kind"] == "start"]
    assert tags.count("next") == tags.count("later") == tags.count("long") == 1, tags
