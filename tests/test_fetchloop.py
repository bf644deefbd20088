"""The fetch loop, ledger and scheduler together, on the in-memory broker with a simulated clock.

Fast and deterministic: what the real-broker tests show with real workers
(time shares, headroom, idle back-off, bad messages), here in milliseconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from celery_prio.brokers.memory import Malformed, MemoryDoorbell, MemoryFetchSource
from celery_prio.ops.simulate import SimLoop
from celery_prio.policy.count_scheduler import scheduler_for
from celery_prio.policy.served import ServedQueues
from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS, Tier
from celery_prio.worker.fetchloop import FetchLoop
from celery_prio.worker.ledger import Ledger
from celery_prio.worker.stats import WorkerStats

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


@dataclass(frozen=True)
class Task:
    tier: Tier
    seconds: float
    key: int


@dataclass
class SimWorker:
    """Runs delivered tasks for their simulated duration and frees their slot."""

    sim: SimLoop
    loop: FetchLoop
    held: set = field(default_factory=set)
    runs: list = field(default_factory=list)  # (tier, start, end)
    peak_low: int = 0

    def deliver(self, tier: Tier, task: Task) -> None:
        self.held.add(task.key)
        self.loop.started(task.key, tier)
        start = self.sim.now
        self.peak_low = max(self.peak_low, self.loop.ledger.running(B) + self.loop.ledger.running(O))

        def done() -> None:
            self.held.discard(task.key)
            self.runs.append((tier, start, self.sim.now))
            self.loop.settle(self.held)

        self.sim.call_later(task.seconds, done)


def make(concurrency=4, **overrides):
    settings = load_settings({}, {"queue_prefix": "m", **overrides})
    served = ServedQueues(settings, [settings.queue_name(t) for t in TIERS])
    source = MemoryFetchSource(served, settings)
    scheduler = scheduler_for(
        settings.scheduler,
        weights=settings.weights,
        concurrency=concurrency,
        reserve=settings.effective_reserve(concurrency),
        min_share=settings.min_share,
    )
    sim = SimLoop()
    loop = FetchLoop(source, scheduler, WorkerStats(), sim, SimLoop.cancel, lambda: sim.now, settings.poll_interval)
    worker = SimWorker(sim, loop)
    loop.deliver = worker.deliver
    return settings, source, sim, loop, worker


_keys = itertools.count()


def backlog(settings, source, counts: dict[Tier, tuple[int, float]]) -> None:
    for tier, (n, seconds) in counts.items():
        source.publish(settings.queue_name(tier), *(Task(tier, seconds, next(_keys)) for _ in range(n)))


def busy_share(runs, until: float) -> dict[Tier, float]:
    busy = {t: sum(max(0.0, min(end, until) - start) for tier, start, end in runs if tier is t) for t in TIERS}
    total = sum(busy.values())
    return {t: busy[t] / total for t in TIERS}


def test_backlogged_tiers_share_slot_time_by_weight_whatever_their_task_lengths():
    settings, source, sim, loop, worker = make(min_share=0, reserve=0)
    backlog(settings, source, {R: (5000, 0.02), B: (1000, 0.1), O: (200, 0.4)})
    loop.start()
    sim.run_until(20.0)
    shares = busy_share(worker.runs, 20.0)
    assert shares[R] == pytest.approx(8 / 11, abs=0.03), shares
    assert shares[B] == pytest.approx(2 / 11, abs=0.03), shares
    assert shares[O] == pytest.approx(1 / 11, abs=0.03), shares


def test_batch_and_offline_never_take_the_reserved_slot():
    settings, source, sim, loop, worker = make(concurrency=4, reserve=1)
    backlog(settings, source, {B: (500, 0.1), O: (100, 0.4)})
    loop.start()
    sim.run_until(10.0)
    assert worker.peak_low == 3
    # A realtime arrival starts at once: the reserved slot is free.
    source.publish(settings.queue_name(R), Task(R, 0.02, next(_keys)))
    arrival = sim.now
    loop.pump()
    sim.run_until(arrival + 0.001)
    assert loop.ledger.running(R) == 1  # started at the arrival, beside three low-tier tasks


def test_an_idle_worker_backs_off_to_one_round_per_poll_interval():
    settings, source, sim, loop, _ = make()
    loop.start()
    sim.run_until(10.0)
    rounds = source.broker_calls / len(source.served.all_names())  # each queue asked once per round
    assert rounds <= 10.0 / settings.poll_interval * 1.05 + 5, rounds


def test_malformed_messages_go_to_the_dead_letters_and_the_loop_goes_on():
    settings, source, sim, loop, _ = make()
    queue = settings.queue_name(B)
    source.publish(queue, *(Malformed(f"bad {i}") for i in range(5)), Task(B, 0.01, next(_keys)))
    loop.start()
    sim.run_until(0.001)
    assert [reason for _, reason, _ in source.dead] == [f"bad {i}" for i in range(5)]
    assert loop.ledger.running(B) == 1  # delivered in the same turn as the five were moved aside


def test_pushed_arrivals_wake_the_loop_once_per_turn_and_stop_gives_back():
    """A source the broker pushes to calls ``on_arrival``: one pump on the next turn, however many arrive."""
    settings, source, sim, loop, _ = make()
    pumps, stopped = [], []
    real_pump = loop.pump
    loop.pump = lambda: pumps.append(sim.now) or real_pump()
    source.stop = lambda: stopped.append(True)
    assert source.free_slots() == 4  # the loop tells the source how many messages may come
    loop.start()
    sim.run_until(0.001)
    pumps.clear()
    source.publish(settings.queue_name(B), *(Task(B, 0.01, next(_keys)) for _ in range(3)))
    for _ in range(3):
        source.on_arrival()
    sim.run_until(sim.now + 0.0001)
    assert len(pumps) == 1 and loop.ledger.running(B) == 1  # one pump (a new tier gets one slot at first)
    loop.stop()
    source.on_arrival()  # a late arrival after stop: no pump
    sim.run_until(sim.now + 0.0001)
    assert len(pumps) == 1 and stopped == [True]


def test_a_push_of_a_tier_the_idle_loop_did_not_ask_waits_for_a_slot_to_free():
    """With batch at its slots and one kept for realtime, the idle loop asks realtime only: a batch push does
    not pump (a drain of short tasks would pump once per push for nothing), a realtime push does."""
    settings, source, sim, loop, _ = make(concurrency=2)
    source.doorbell = MemoryDoorbell()  # an idle loop waits (as a pushed source does) instead of polling
    source.publish(settings.queue_name(B), Task(B, 10.0, next(_keys)))
    loop.start()
    sim.run_until(0.01)
    assert loop.ledger.running(B) == 1  # batch holds its one slot; the other is realtime's
    pumps = []
    real_pump = loop.pump
    loop.pump = lambda: pumps.append(sim.now) or real_pump()
    source.publish(settings.queue_name(B), Task(B, 0.01, next(_keys)))
    source.on_delivery(B)
    sim.run_until(sim.now + 0.001)
    assert pumps == []  # no slot it could take: left until one frees
    source.publish(settings.queue_name(R), Task(R, 0.01, next(_keys)))
    source.on_delivery(R)
    sim.run_until(sim.now + 0.001)
    assert len(pumps) == 1 and loop.ledger.running(R) == 1


def test_a_failing_fetch_is_retried_not_fatal():
    settings, source, sim, loop, worker = make()
    take, calls = source.take, []

    def flaky(order):
        calls.append(sim.now)
        if len(calls) <= 2:
            raise RuntimeError("broker hiccup")
        return take(order)

    source.take = flaky
    backlog(settings, source, {R: (3, 0.01)})
    loop.start()
    sim.run_until(1.0)
    assert len(worker.runs) == 3 and len(calls) >= 3


def test_ledger_settles_only_what_left_and_charges_its_run_time():
    ledger = Ledger()
    ledger.start("a", R, 0.1, now=10.0)
    ledger.start("b", O, 2.0, now=11.0)
    assert ledger.settle({"a", "b"}, now=12.0) == []
    (settled,) = ledger.settle({"b"}, now=12.5)
    assert (settled.tier, settled.runtime, settled.charge) == (R, 2.5, 0.1)
    assert len(ledger) == 1 and ledger.running(O) == 1 and "b" in ledger


def test_served_queues_ask_the_front_lane_first_then_take_turns():
    settings = load_settings({}, {"queue_prefix": "m"})
    served = ServedQueues(settings, ["m.batch", "tenant-a", "m.realtime"])
    batch = served.candidates(B)  # a queue that is no tier queue belongs to the default tier (batch)
    assert [c.name for c in batch] == ["m.batch.promoted", "m.batch", "tenant-a"]
    served.finished("m.batch", 0.1, served.dispatched("m.batch"))
    assert [c.name for c in served.candidates(B)] == ["m.batch.promoted", "tenant-a", "m.batch"]
    assert [c.name for c in served.candidates(R)] == ["m.realtime.promoted", "m.realtime"]
    assert served.tiers == [R, B]


def test_discovered_subqueues_are_served_with_their_tier():
    settings = load_settings({}, {"queue_prefix": "m"})
    served = ServedQueues(settings, ["m.batch", "m.realtime"])
    served.set_discovered(["m.batch.acme", "m.offline.zeta", "m.batch.promoted", "other.batch.x"])
    assert served.by_tier[B] == ["m.batch", "m.batch.acme"]
    assert served.by_tier[O] == []  # offline is not served here: neither are its sub-queues
    assert "m.batch.promoted" not in served.by_tier[B]  # a front lane is no sub-queue


def test_on_a_solo_pool_a_refill_waits_for_the_other_callbacks_of_its_turn():
    """Issue 34: ``-P solo`` runs a task on the event loop's thread, inside the refill. Celery queues an
    ``acks_late`` ack on the same loop (kombu's hub runs a turn's callbacks in no set order): a refill that
    ran inline could run the next task, however long, before the previous one's ack. On kombu's own hub."""
    from kombu.asynchronous import Hub

    settings, source, _, loop, _ = make(concurrency=1, reserve=0, min_share=0)
    hub = Hub()
    loop.loop, loop.cancel_timer = hub, hub.timer.cancel
    order: list[str] = []

    def run_on_this_thread(tier: Tier, task: Task) -> None:
        order.append(f"run {task.key}")
        loop.started(task.key, tier)

    loop.deliver = run_on_this_thread
    loop.defer_refill = True
    backlog(settings, source, {B: (2, 0.0)})
    loop.active = True
    loop.pump()
    first = order[0]

    def task_ended() -> None:  # one turn: the slot frees (our refill), Celery's ack runs (its callback)
        loop.settle(set())
        order.append("ack")

    hub.call_soon(task_ended)
    turns = hub.create_loop()
    for _ in range(3):
        next(turns)
    assert order[:3] == [first, "ack", f"run {int(first.split()[1]) + 1}"], order
