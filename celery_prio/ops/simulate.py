"""The policy simulator: the real scheduler and fetch loop on a virtual clock, over a workload.

``celery -A app prio simulate SPEC`` replays a workload against the app's
settings and against alternatives, side by side. What runs is the worker's
own code — :class:`~celery_prio.worker.fetchloop.FetchLoop` (one message per free
slot; an idle worker waits on its tiers' doorbells),
:class:`~celery_prio.policy.scheduler.TierScheduler` (time shares, reserve,
floor, cold start, preemption of sliced tasks) and
:class:`~celery_prio.policy.served.ServedQueues` (front lanes) — against the
in-memory broker, with a simulated event loop instead of the worker's hub.
Modelled around it: several workers sharing the queues, Poisson arrivals and
backlogs, run-time distributions, a per-task dispatch overhead (broker round
trips and the pool hand-off), aging (promotion into the upper tier's front
lane past the threshold, every ``prio_aging_interval``) and GPU time slices
(a task made of elements yields between them the way ``celery_prio.slices``
does), admission by predicted wait (``prio_max_wait``: the work waiting in
the tier, by the workers' measured per-call estimates, over their slots;
the estimates reach the publishers at once, where real fleets share them
within 25-100 ms) and realtime deadlines (``prio_realtime_deadline``: a call
fetched past it is counted expired, never run). Not modelled: sub-queues,
SJF order among several realtime task names, message caps, broker failures. A workload whose outcome would depend
on the first two is refused with the reason (``unmodelled``), never
simulated wrongly.

The workload (``workload.py``) is a small spec of streams, or a trace recorded by real
workers (``prio_trace_file``).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from ..brokers.memory import MemoryDoorbell, MemoryFetchSource
from ..policy.admission import predicted_wait, slot_share
from ..policy.count_scheduler import scheduler_for
from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from ..worker.fetchloop import FetchLoop
from ..worker.stats import WorkerStats, percentile
from .workload import Stream, Workload


class SimLoop:
    """A virtual-time event loop with the kombu Hub calls the fetch loop uses (call_soon, call_later)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def call_soon(self, callback, *args):
        return self.call_later(0.0, callback, *args)

    def call_later(self, delay, callback, *args):
        entry = [self.now + delay, next(self._seq), callback, args, False]
        heapq.heappush(self._events, entry)
        return entry

    @staticmethod
    def cancel(entry) -> None:
        entry[4] = True

    def run_until(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            at, _, callback, args, cancelled = heapq.heappop(self._events)
            self.now = at
            if not cancelled:
                callback(*args)
        self.now = until


@dataclass
class Task:
    key: int
    stream: Stream
    seconds: float
    enqueued_at: float
    tier: Tier
    elements_left: int = 0
    started: bool = False  # a continuation's wait is not a new arrival's


@dataclass
class TierResult:
    arrived: int = 0
    completed: int = 0
    completed_in_window: int = 0  # finished while arrivals were still coming (before ``duration``)
    promoted: int = 0
    yields: int = 0
    refused: int = 0  # publishes refused for their predicted wait (429)
    expired: int = 0  # realtime calls fetched past their deadline: not run
    on_time: int = 0  # realtime calls answered within prio_realtime_target, publish to done
    busy_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    longest_wait_s: float = 0.0

    def summary(self, total_busy: float) -> dict[str, Any]:
        def ms(values: list[float], q: float) -> float | None:
            p = percentile(values, q)
            return None if p is None else round(p * 1000, 1)

        return {
            "arrived": self.arrived,
            "completed": self.completed,
            "completed_in_window": self.completed_in_window,
            "wait_p50_ms": ms(self.waits, 50),
            "wait_p99_ms": ms(self.waits, 99),
            "latency_p99_ms": ms(self.latencies, 99),
            "slot_time_share": round(self.busy_s / total_busy, 4) if total_busy else 0.0,
            "longest_wait_s": round(self.longest_wait_s, 3),
            "promoted": self.promoted,
            "yields": self.yields,
            "refused": self.refused,
            "expired": self.expired,
            "on_time": self.on_time,
        }


class _Worker:
    def __init__(self, sim: Simulation, index: int) -> None:
        settings, workload = sim.settings, sim.workload
        self.sim = sim
        self.served = ServedQueues(settings, [settings.queue_name(t) for t in TIERS])
        self.source = MemoryFetchSource(self.served, settings, sim.doorbell)
        self.source.queues = sim.queues  # one broker for every worker
        self.scheduler = scheduler_for(
            settings.scheduler,
            weights=settings.weights,
            concurrency=workload.concurrency,
            reserve=settings.effective_reserve(workload.concurrency),
            min_share=settings.min_share,
            idle_share=settings.idle_share,
        )
        clock = sim.loop
        self.loop = FetchLoop(
            self.source,
            self.scheduler,
            WorkerStats(),
            clock,
            SimLoop.cancel,
            lambda: clock.now,
            settings.poll_interval,
            lanes=self.served,
        )
        self.loop.deliver = self.deliver
        self.held: set[int] = set()
        self.name = f"worker{index}"

    def deliver(self, tier: Tier, task: Task) -> None:
        sim, now = self.sim, self.sim.loop.now
        result = sim.results[task.stream.tier]  # waits and completions count for the tier it was sent to
        if not task.started:
            deadline = sim.settings.realtime_deadline
            if task.stream.tier is Tier.REALTIME and deadline > 0 and now - task.enqueued_at > deadline:
                result.expired += 1  # Celery marks it expired and acks it unrun: no slot taken
                return
            task.started = True
            wait = now - task.enqueued_at
            result.waits.append(wait)
            result.longest_wait_s = max(result.longest_wait_s, wait)
        self.held.add(task.key)
        self.loop.started(task.key, tier)
        if task.elements_left and sim.settings.slice[tier] is not None:
            per = task.seconds / max(task.elements_left, 1)
            sim.loop.call_later(sim.workload.overhead_s + per, self._element_done, tier, task, now, per)
        else:
            sim.loop.call_later(sim.workload.overhead_s + task.seconds, self._done, tier, task, now)

    def _element_done(self, tier: Tier, task: Task, began: float, per: float) -> None:
        sim = self.sim
        task.elements_left -= 1
        task.seconds = max(task.seconds - per, 0.0)
        if task.elements_left <= 0:
            self._done(tier, task, began)
            return
        if sim.loop.now - began >= sim.settings.slice[tier] and self._should_yield(tier):
            # celery_prio.slices: the continuation goes to the tier's front lane, the slot to the waiting tier.
            sim.results[tier].yields += 1
            self._release(tier, task, began)
            sim.put(sim.settings.front_lanes()[tier], task, tier)
            return
        sim.loop.call_later(per, self._element_done, tier, task, began, per)

    def _should_yield(self, tier: Tier) -> bool:
        now = self.sim.loop.now
        preemptors = self.scheduler.preemptors({tier}, self.loop.ledger.overrun(now)).get(tier, set())
        for higher in sorted(preemptors):
            if any(self.sim.queues.get(c.name) for c in self.served.candidates(higher)):
                self.scheduler.hand_off_to(higher)
                return True
        return False

    def _done(self, tier: Tier, task: Task, began: float) -> None:
        sim = self.sim
        result = sim.results[task.stream.tier]
        result.completed += 1
        if sim.loop.now <= sim.workload.duration:
            result.completed_in_window += 1
        latency = sim.loop.now - task.enqueued_at
        result.latencies.append(latency)
        result.on_time += task.stream.tier is Tier.REALTIME and latency <= sim.settings.realtime_target
        self._release(tier, task, began)

    def _release(self, tier: Tier, task: Task, began: float) -> None:
        self.sim.results[tier].busy_s += self.sim.loop.now - began  # slot time counts for the tier it ran in
        self.held.discard(task.key)
        self.loop.settle(self.held)


def unmodelled(workload: Workload, settings: PrioSettings) -> str | None:
    """Why the simulator cannot stand for ``workload`` under ``settings`` (None: it can)."""
    names = sorted({s.name or "(unnamed)" for s in workload.streams if s.tier is Tier.REALTIME})
    if settings.sjf and len(names) > 1:
        return (
            f"the realtime streams name {len(names)} tasks ({', '.join(names)}) and prio_sjf is on: the simulator "
            "does not model shortest-job-first order between them; give them one name, or compare with --set sjf=false"
        )
    sjf_head = settings.subqueue_name(Tier.REALTIME, "sjf-")
    subqueues = sorted(q for q in workload.queues if settings.is_subqueue(q) and not q.startswith(sjf_head))
    if subqueues:
        return f"the trace uses sub-queues ({', '.join(subqueues[:5])}), which the simulator does not model"
    return None


class Simulation:
    def __init__(self, workload: Workload, settings: PrioSettings) -> None:
        problem = unmodelled(workload, settings)
        if problem:
            raise ValueError(f"cannot simulate this workload: {problem}")
        self.workload = workload
        self.settings = settings
        self.loop = SimLoop()
        self.queues: dict[str, deque] = defaultdict(deque)
        self.doorbell = MemoryDoorbell()  # idle workers block on it, as on real brokers (no poll)
        self.results = {t: TierResult() for t in TIERS}
        self.rng = random.Random(workload.seed)
        self._keys = itertools.count()
        self.workers = [_Worker(self, i) for i in range(workload.workers)]

    def publish(self, stream: Stream, seconds: float | None = None) -> None:
        run_time = stream.seconds.sample(self.rng) if seconds is None else seconds
        task = Task(next(self._keys), stream, run_time, self.loop.now, stream.tier, stream.elements)
        self.results[stream.tier].arrived += 1
        if self._over_budget(stream.tier):
            self.results[stream.tier].refused += 1
            return
        self.put(self.settings.queue_name(stream.tier), task, stream.tier)

    def _over_budget(self, tier: Tier) -> bool:
        """Admission by predicted wait, as the publish script does it (``policy/admission.py``)."""
        budget = self.settings.max_wait[tier]
        if budget is None:
            return False
        weights, concurrency = self.settings.weights, self.workload.concurrency
        slots = sum(slot_share(concurrency, tier, TIERS, weights) for _ in self.workers)
        measured: dict[str, list[float]] = {}
        for worker in self.workers:
            for name, each in worker.served.per_call_estimates([tier]).items():
                measured.setdefault(name, []).append(each)
        names = [self.settings.queue_name(tier), self.settings.front_lanes().get(tier)]
        waiting = [
            (len(self.queues.get(n, ())), sum(measured[n]) / len(measured[n]) if n in measured else None)
            for n in names
            if n
        ]
        wait = predicted_wait(waiting, slots)
        return wait is not None and wait > budget

    def put(self, queue: str, task: Task, tier: Tier) -> None:
        """Into ``queue`` of ``tier``, ringing the tier's doorbell (the publish, aging and yield scripts do)."""
        self.queues[queue].append(task)
        self.doorbell.ring(tier)

    def _age(self) -> None:
        now = self.loop.now
        for tier in (Tier.BATCH, Tier.OFFLINE):  # batch -> realtime first, as the workers do
            threshold = self.settings.aging[tier]
            if threshold is None:
                continue
            upper = self.settings.front_lanes()[tier.promoted()]
            for name in (self.settings.queue_name(tier), self.settings.front_lanes().get(tier)):
                queue = self.queues.get(name) if name else None
                while queue and now - queue[0].enqueued_at >= threshold:
                    task = queue.popleft()
                    task.tier = tier.promoted()
                    self.results[tier].promoted += 1
                    self.put(upper, task, tier.promoted())
        self.loop.call_later(self.settings.aging_interval, self._age)

    def _arrivals(self) -> None:
        workload = self.workload
        if workload.arrivals is not None:
            for at, stream, seconds in workload.arrivals:
                self.loop.call_later(at, self.publish, stream, seconds)
            return
        for stream in workload.streams:
            for _ in range(stream.backlog):
                self.publish(stream)
            if stream.rate > 0:
                t = self.rng.expovariate(stream.rate)
                while t < workload.duration:
                    self.loop.call_later(t, self.publish, stream)
                    t += self.rng.expovariate(stream.rate)

    def run(self) -> dict[str, Any]:
        self._arrivals()
        if any(self.settings.aging[t] is not None for t in (Tier.BATCH, Tier.OFFLINE)):
            self.loop.call_later(self.settings.aging_interval, self._age)
        for worker in self.workers:
            worker.loop.start()
        end = self.workload.duration + self.workload.grace
        self.loop.run_until(end)
        for queue in self.queues.values():  # still waiting at the end: they waited that long
            for task in queue:
                if not task.started:
                    result = self.results[task.stream.tier]
                    result.longest_wait_s = max(result.longest_wait_s, end - task.enqueued_at)
        total = sum(r.busy_s for r in self.results.values())
        return {t.label: self.results[t].summary(total) for t in TIERS}


def simulate(workload: Workload, settings: PrioSettings) -> dict[str, Any]:
    """Per tier: arrivals, completions, wait P50/P99, latency P99, slot-time share, longest wait, promotions."""
    return Simulation(workload, settings).run()
