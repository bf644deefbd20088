"""Which queues a worker serves, grouped by tier, in the order it asks them. Pure.

A worker consumes the tier queues its ``-Q`` names (plus any queue added at
run time). Inside a tier the queues are asked round robin; a tier that
receives promotions (aging) has a ``.promoted`` sub-queue that is asked
first, oldest first, on both brokers. Queues that are not tier queues count
as sub-queues of the default tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..settings import PrioSettings
from ..settings.naming import TASK_SUBQUEUE_PREFIX
from ..tiers import TIERS, Tier
from .queue_shares import QueueShares, QueueState

#: Weight of the newest batch in a batched queue's calls per run.
BATCH_SIZE_ALPHA = 0.2
#: Queue names whose tier ``tier_of`` remembers (routing keys are anyone's input: bounded).
TIER_OF_REMEMBERED = 10_000

#: Aging moves batch -> realtime and offline -> batch.
AGING_TIERS = (Tier.BATCH, Tier.OFFLINE)


@dataclass(frozen=True)
class Candidate:
    """One queue to ask for ``tier``'s next message."""

    tier: Tier
    name: str
    lane: bool = False  # the tier's front lane (promoted / resumed work), asked first


class ServedQueues:
    def __init__(
        self, settings: PrioSettings, names: Iterable[str] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.names: list[str] = []
        self.discovered: list[str] = []
        self.known: list[str] = []  # sub-queues served without discovery (shortest-first queues of realtime tasks)
        #: The per-task sub-queues (``sjf-<task>``) of the tasks this worker has registered; None: any. Another
        #: app's per-task queues on the same broker are never served here (it could not run their tasks).
        self.registered: frozenset[str] | None = None
        self.shares = {t: QueueShares(settings.subqueue_weight) for t in TIERS}
        self._tiers: dict[str, Tier] = {}  # tier_of's answers
        self.version = 0  # bumped whenever the set of served queues may have changed
        self.runs = 0  # runs (and batches) charged so far: the estimates may have moved when it changes
        self.on_run: Callable[[str], None] = lambda queue: None  # after each, with its queue (estimates moved)
        self.calls_per_run: dict[str, float] = {}  # a batched task's queue -> its calls per run (a moving mean)
        self.set_names(names)

    def tier_of(self, name: str) -> Tier:
        tier = self._tiers.get(name)
        if tier is None:  # parsed once per name (a fetch of 500 sub-queues asks it for each)
            parsed = self.settings.tier_for_queue(name)
            tier = self.settings.default_tier if parsed is None else parsed
            if len(self._tiers) < TIER_OF_REMEMBERED:
                self._tiers[name] = tier
        return tier

    def set_names(self, names: Iterable[str]) -> None:
        """The queues the worker consumes (``-Q``, ``add_consumer``)."""
        self.names = list(dict.fromkeys(names))
        self._regroup()

    def set_discovered(self, names: Iterable[str]) -> None:
        """Sub-queues published to since (found in the broker): served where the worker serves their tier."""
        self.discovered = [n for n in dict.fromkeys(names) if self.settings.is_subqueue(n)]
        self._regroup()

    def set_known(self, names: Iterable[str]) -> None:
        self.known = [n for n in dict.fromkeys(names) if self.settings.is_subqueue(n)]
        self._regroup()

    def set_registered(self, task_subqueues: Iterable[str]) -> None:
        """The per-task sub-queue names (``settings.sjf_subqueue(task)``) of the tasks this worker can run."""
        self.registered = frozenset(task_subqueues)
        self._regroup()

    def _runs_here(self, name: str, tier: Tier) -> bool:
        sub = self.settings.subqueue_of(name, tier) or ""
        return self.registered is None or not sub.startswith(TASK_SUBQUEUE_PREFIX) or sub in self.registered

    def _regroup(self) -> None:
        self.version += 1
        by_tier = {t: [n for n in self.names if self.tier_of(n) is t] for t in TIERS}
        members = {t: set(names) for t, names in by_tier.items()}  # the same as sets: 500 sub-queues, no scans
        for name in [*self.known, *self.discovered]:
            tier = self.tier_of(name)
            if not self._runs_here(name, tier):
                continue
            # A worker serves a tier's sub-queues when it serves the tier's own queue.
            if self.settings.queue_name(tier) in members[tier] and name not in members[tier]:
                by_tier[tier].append(name)
                members[tier].add(name)
        self.by_tier = by_tier
        # Each served queue's tier shares, looked up per task (dispatch, finish, wait): one dict, no parse.
        self._shares_by_queue = {name: self.shares[t] for t, names in by_tier.items() for name in names}
        for tier in TIERS:
            self.shares[tier].forget(by_tier[tier])
        self.promoted = {
            tier: lane
            for tier, lane in self.settings.front_lanes().items()
            if self.settings.queue_name(tier) in self.by_tier[tier]
        }

    @property
    def tiers(self) -> list[Tier]:
        """Tiers with at least one served queue."""
        return [t for t in TIERS if self.by_tier[t]]

    def all_names(self) -> list[str]:
        """Every queue a fetch may ask, front lanes and sub-queues included."""
        return [n for t in TIERS for n in self.by_tier[t]] + list(self.promoted.values())

    def candidates(self, tier: Tier, keep: Callable[[str], bool] | None = None) -> list[Candidate]:
        """``tier``'s queues in asking order: the front lane first, then by their share of the tier's time.

        With ``keep``, only the queues it keeps are ordered (the others are known to be empty: 500 tenants,
        most of them idle, are not sorted on every fetch); the order among those kept is the same, and a
        queue kept again after it was found empty comes back level (``QueueShares.order``).
        """
        out = [Candidate(tier, self.promoted[tier], lane=True)] if tier in self.promoted else []
        shares, names = self.shares[tier], self.by_tier[tier]
        if keep is not None:
            names = [n for n in names if keep(n)]
        if tier is Tier.REALTIME and self.settings.sjf:
            ordered = shares.order_shortest_first(names, self.clock(), self.settings.sjf_max_wait)
        else:
            ordered = shares.order(names, lift_idle=keep is not None)
        out.extend([Candidate(tier, name) for name in ordered])
        return out

    def asking_order(self, tier: Tier, active: AbstractSet[str]) -> list[str]:
        """The names of ``candidates(tier, active.__contains__)`` that ``active`` holds, in that order and with
        the same effect on the shares. One queue is not ordered: a tier draining one queue asks this once per
        task, and building and sorting its candidates was most of a take's cost."""
        if len(active) != 1:
            return [c.name for c in self.candidates(tier, active.__contains__) if c.name in active]
        (name,) = active
        if name != self.promoted.get(tier) and not (tier is Tier.REALTIME and self.settings.sjf):
            self.shares[tier].lift_if_idle(name)  # what ``order`` does to a queue it is given, when kept
        return [name]

    # -- the tier's time among its queues ------------------------------------------------
    def _shares_of(self, queue: str) -> QueueShares | None:
        return self._shares_by_queue.get(queue)  # front lanes: not shared

    # ``dispatched``, ``finished`` and ``observe_wait`` run once per task a worker runs: ``_shares_of`` written out.
    def dispatched(self, queue: str) -> float:
        shares = self._shares_by_queue.get(queue)
        if shares is None:
            return 0.0
        return shares.dispatched(queue, self.clock())

    def finished(self, queue: str, runtime: float, charge: float) -> None:
        self.runs += 1
        self.on_run(queue)
        shares = self._shares_by_queue.get(queue)
        if shares is not None:
            shares.finished(queue, runtime, charge)

    def empty(self, queue: str) -> None:
        shares = self._shares_of(queue)
        if shares is not None:
            shares.looked_at(queue, self.clock())
            shares.empty(queue)

    def observe_wait(self, queue: str, wait: float) -> None:
        shares = self._shares_by_queue.get(queue)
        if shares is not None:
            shares.observe_wait(queue, wait)

    def batch_ran(self, queue: str, calls: int) -> None:
        """A batch of ``calls`` from ``queue`` ran as one: its run time counts ``calls`` calls."""
        self.runs += 1
        self.on_run(queue)
        before = self.calls_per_run.get(queue)
        self.calls_per_run[queue] = float(calls) if before is None else before + BATCH_SIZE_ALPHA * (calls - before)

    def per_call_estimates(self, tiers: Iterable[Tier] = TIERS) -> dict[str, float]:
        """What one call of each measured queue of ``tiers`` runs for: the queue's run-time estimate, over its
        calls per run for a batched task's (a batch of 32 that runs 0.3 s is 10 ms a call). Shared with the
        fleet for admission by predicted wait."""
        wanted = set(tiers)
        return {
            name: state.estimate / max(1.0, self.calls_per_run.get(name, 1.0))
            for tier, name, state in self.queue_states()
            if tier in wanted and state.measured
        }

    def queue_states(self) -> list[tuple[Tier, str, QueueState]]:
        """Every served queue of every tier with its figures (for the report)."""
        return [(tier, name, state) for tier, shares in self.shares.items() for name, state in shares.queues.items()]
