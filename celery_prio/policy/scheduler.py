"""Which tier gets the next free worker slot. Pure: no Celery, no clock.

The seed allocates *GPU time* between tiers 8:2:1, so weights are shares of
slot time, not of dispatches. Each tier carries a virtual time: dispatching a
task charges the tier its expected run time divided by its weight, and when
the task finishes the charge is corrected to the measured run time (start-time
fair queueing with a per-tier run-time estimate). The tier with the smallest
virtual finish tag goes first. A count mode (charge 1 per dispatch,
``count_scheduler.py``) exists for comparison only: with 20 ms realtime tasks
and 400 ms offline tasks it gives realtime far less than 8/11 of the time.

Around that core:
* work conserving: the caller tries tiers in the returned order and skips the
  empty ones. What an idle tier's weight does is ``idle_share``:
  ``"proportional"`` (default, the seed's weighted round robin and what fair
  queueing does): it is simply not used, so the busy tiers share the slots in
  their configured ratio (realtime quiet: batch:offline 2:1);
  ``"next_below"``: it goes to the next busy tier *below* it (realtime's
  unused time to batch, batch's to offline), so quiet online traffic speeds
  up batch jobs rather than offline work (realtime quiet: 10:1). Offline keeps
  its floor either way;
* headroom: batch/offline together never occupy more than
  ``concurrency - reserve`` slots, so a realtime arrival never waits behind a
  long evaluation;
* minimum share: while offline has work it gets at least ``min_share`` per
  100 of what is being shared, i.e. per cent of slot time (dispatches per 100
  in count mode), even if realtime alone could fill the worker. (A dispatch-count floor in time mode
  would hand 2-second offline
  tasks a third of the GPU whenever realtime sends many 20 ms requests.);
* an idle tier does not bank credit: when a fetch finds it empty its virtual
  time is lifted to the current virtual clock, so it cannot burst past the
  others when work arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ..settings.table import IDLE_SHARE_RULES
from ..tiers import TIERS, Tier
from .fairshare import Flow

#: Each tier's rank, for ties (``Tier.value`` is a property call on every read).
RANK = {t: t.value for t in TIERS}
#: The tiers the headroom (``prio_reserve``) holds back.
LOW_TIERS = (Tier.BATCH, Tier.OFFLINE)
#: Distinct tier states whose effective weights are kept (3 tiers idle or not, times ``busy_now`` sets: a few).
WEIGHTS_CACHE_MAX = 64


@dataclass
class TierState(Flow):
    """A tier as a flow (``fairshare.Flow``), with its weight and its tasks in slots."""

    weight: float = 1.0
    running: int = 0
    finished: int = 0


@dataclass
class TierScheduler:
    weights: Mapping[Tier, float]
    concurrency: int
    reserve: int = 0
    min_share: float = 5.0
    idle_share: str = "proportional"
    served: frozenset[Tier] = frozenset(TIERS)
    #: Known run times (seconds) per tier; unknown tiers start at ``fairshare.DEFAULT_ESTIMATE``.
    estimates: Mapping[Tier, float] | None = None
    tiers: dict[Tier, TierState] = field(init=False)
    #: A tier a sliced task just gave its slot to: first for the next free slot (see :meth:`hand_off_to`).
    hand_off: Tier | None = field(init=False, default=None)
    #: Per tier, its running tasks that are blocked waiting on other tasks' results (``celery_prio.wait``, or a
    #: plain ``AsyncResult.get()``/``GroupResult.get()``/``join`` inside a task; told by the worker). They hold a
    #: pool process but not the tier's turn: see ``_may_take_another`` and ``_low_tiers_allowed``.
    blocked: dict[Tier, int] = field(init=False, default_factory=dict)
    vclock: float = field(init=False, default=0.0)
    _weights_cache: dict[tuple[object, ...], dict[Tier, float]] = field(init=False, default_factory=dict, repr=False)
    _states: tuple[TierState, ...] = field(init=False, default=(), repr=False)
    _running: int = field(init=False, default=0, repr=False)
    #: What a dispatch is charged: its expected run time (``prio_scheduler = "time"``), corrected to the
    #: measured run time when it ends.
    mode: ClassVar[str] = "time"
    corrects_charges: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.idle_share not in IDLE_SHARE_RULES:
            raise ValueError(f"idle_share must be one of {IDLE_SHARE_RULES}, got {self.idle_share!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency!r}")
        self.tiers = {t: TierState(weight=float(self.weights[t])) for t in TIERS}
        self._states = tuple(self.tiers.values())  # the same, in ``TIERS`` order, for the per-task questions
        for tier, seconds in (self.estimates or {}).items():
            self.tiers[tier].estimate, self.tiers[tier].measured = float(seconds), True

    # -- questions -------------------------------------------------------
    # The questions below are asked several times per task a worker runs (each free slot's order, each take's
    # hold target): written as plain loops over the three tiers, not generators.
    @property
    def running(self) -> int:
        return self._running  # the tiers' ``running`` summed, kept by ``dispatched`` and ``finished``

    def free_slots(self) -> int:
        return max(self.concurrency - self._running, 0)

    def _may_take_another(self, tier: Tier) -> bool:
        state = self.tiers[tier]
        if tier is Tier.REALTIME or state.measured or Tier.REALTIME not in self.served:
            return True  # the one-slot rule protects realtime arrivals: moot on a worker that serves none
        return state.running <= self.blocked.get(tier, 0)

    def _low_tiers_allowed(self) -> bool:
        # A batch task blocked on its own group (``.get(disable_sync_subtasks=False)``) waits for work that can
        # only run in another slot: counted against the headroom it would deadlock a worker whose one other
        # slot is the reserve (plain Celery runs the children there). Realtime then waits for that child.
        blocked, low = self.blocked, 0
        for tier in LOW_TIERS:
            running = self.tiers[tier].running
            if running:
                low += max(running - blocked.get(tier, 0), 0) if blocked else running
        return low < self.concurrency - self.reserve

    def effective_weights(self, busy_now: Iterable[Tier] = ()) -> dict[Tier, float]:
        """Weights after idle tiers hand theirs down (``idle_share="next_below"``) and the offline floor applies.

        ``busy_now``: tiers known to have work although their last fetch found none.
        """
        return dict(self._weights(frozenset(busy_now)))

    def _weights(self, busy_now: frozenset[Tier] = frozenset()) -> Mapping[Tier, float]:
        """``effective_weights``, not copied: asked three times per task (order, dispatch, finish) and the same
        until a tier goes idle or busy, so kept per state (the weights themselves are fixed)."""
        realtime, batch, offline = self._states
        key = (self.served, busy_now, realtime.idle, batch.idle, offline.idle)
        cached = self._weights_cache.get(key)
        if cached is not None:
            return cached
        busy = [t for t in TIERS if t in self.served and (not self.tiers[t].idle or t in busy_now)]
        eff = {t: self.tiers[t].weight for t in TIERS}
        for tier in TIERS:
            if self.idle_share == "proportional" or tier in busy or tier not in self.served:
                continue
            below = [t for t in busy if t > tier]
            if below:
                eff[below[0]] += self.tiers[tier].weight
        self._apply_floor(eff, busy)
        if len(self._weights_cache) < WEIGHTS_CACHE_MAX:
            self._weights_cache[key] = eff
        return eff

    def _apply_floor(self, eff: dict[Tier, float], busy: list[Tier]) -> None:
        """Offline's minimum share of slot time, as a weight: ``min_share`` per cent of what busy tiers share."""
        if self.min_share > 0 and Tier.OFFLINE in busy:
            others = sum(eff[t] for t in busy if t is not Tier.OFFLINE)
            floor = others * self.min_share / (100.0 - self.min_share) if self.min_share < 100 else float("inf")
            eff[Tier.OFFLINE] = max(eff[Tier.OFFLINE], floor)

    def _cost(self, state: TierState) -> float:
        return state.estimate

    def order(self) -> list[Tier]:
        """Tiers to try for the next free slot, most deserving first.

        Empty list when no slot is free. The caller fetches from the first
        tier that has a message and reports it with :meth:`dispatched`, or
        reports an empty tier with :meth:`empty`.
        """
        if self.free_slots() <= 0:
            return []
        ranking = self._ranking(headroom=True)
        if self.hand_off in ranking:
            ranking.remove(self.hand_off)
            ranking.insert(0, self.hand_off)
        return ranking

    def _ranking(
        self, headroom: bool, overrun: Mapping[Tier, float] | None = None, busy_now: Iterable[Tier] = ()
    ) -> list[Tier]:
        # Until one of its tasks finished, a batch or offline tier's run time is a
        # guess: give it one slot, not a burst of slots it might hold for minutes.
        # Not realtime: its tasks are short by contract, and a burst into a cold
        # worker (no warm-up) would otherwise queue behind its first task. A task
        # blocked waiting on other work (``blocked``) does not count: what it
        # waits on may be the next task of its own tier (a boosted dependency).
        if headroom and not self._low_tiers_allowed():
            # Realtime alone, which never waits on the one-slot rule.
            candidates = [Tier.REALTIME] if Tier.REALTIME in self.served else []
        else:
            served, may_take = self.served, self._may_take_another
            candidates = [t for t in TIERS if t in served and (t is Tier.REALTIME or may_take(t))]
        if len(candidates) < 2:  # nothing to rank (a slot kept for realtime asks realtime alone once per task)
            return candidates
        weights = self._weights(busy_now if isinstance(busy_now, frozenset) else frozenset(busy_now))
        # Each candidate's finish tag (``Flow.finish_tag`` at ``_cost``) plus its overrun, ties to the higher
        # tier: written out, as this runs for every free slot.
        tiers, cost, ranked = self.tiers, self._cost, []
        for tier in candidates:
            state, weight = tiers[tier], weights[tier]
            tag = state.vtime + cost(state) / weight
            if overrun:
                tag += overrun.get(tier, 0.0) / weight
            ranked.append((tag, RANK[tier], tier))
        ranked.sort()
        return [tier for _, _, tier in ranked]

    def preemptors(self, sliced: Iterable[Tier], overrun: Mapping[Tier, float] | None = None) -> dict[Tier, set[Tier]]:
        """Per running sliced tier, the higher tiers it should give its slot to when they have work.

        Only while no slot is free (a free slot takes the waiting work
        anyway), and only to a *higher* tier that the scheduler would serve
        before the yielding one if that slot were free: a tier over its share
        of slot time does not preempt, so slicing never undoes the weights.
        ``overrun``: per tier, run time of its running tasks beyond their
        charge (``Ledger.overrun``): a task is charged its full run time only
        when it ends, and a long sliced run must count for what it has used
        so far, or it would always look cheaper than the work it should yield
        to. The higher tier is ranked as busy (its last fetch may have found
        it empty, handing its weight down).
        """
        if self.free_slots() > 0:
            return {}
        out: dict[Tier, set[Tier]] = {}
        last = len(TIERS)
        for high in TIERS:
            if high not in self.served:
                continue
            rank = {t: i for i, t in enumerate(self._ranking(headroom=False, overrun=overrun, busy_now={high}))}
            if high not in rank:
                continue
            for low in sliced:
                if low.value > high.value and rank[high] < rank.get(low, last):
                    out.setdefault(low, set()).add(high)
        return out

    def hand_off_to(self, tier: Tier | None) -> None:
        """The next free slot goes to ``tier`` first: a sliced task is yielding it for ``tier``'s waiting work.

        Without this the slot could go to a third tier whose turn it is by
        virtual time (offline at its share), and the work the slice yielded
        for would wait another slice. Cleared when ``tier`` is dispatched or
        found empty.
        """
        self.hand_off = tier

    # -- events ------------------------------------------------------------
    def dispatched(self, tier: Tier) -> float:
        """A message of ``tier`` took a slot. Returns the charge to pass to :meth:`finished`."""
        if tier is self.hand_off:
            self.hand_off = None
        state = self.tiers[tier]
        self.vclock = max(self.vclock, state.vtime)
        charge = state.charge(self._weights()[tier], self._cost(state))
        state.running += 1
        self._running += 1
        return charge

    def finished(self, tier: Tier, runtime: float, charge: float) -> None:
        """A task dispatched from ``tier`` left its slot after ``runtime`` seconds."""
        state = self.tiers[tier]
        if state.running > 0:
            state.running -= 1
            self._running -= 1
        state.finished += 1
        state.settle(runtime, charge, self._weights()[tier], correct=self.corrects_charges)

    def empty(self, tier: Tier) -> None:
        """Fetching from ``tier`` found nothing: it stops banking virtual time.

        Its virtual time is lifted to where the busy tiers' next tasks start
        (the lowest of their virtual times: a returning tier then starts level
        with the most deserving busy tier, not ahead of all of them) and then
        left alone, so that as the busy tiers advance it comes first again and
        is probed at about its own share's rate; lifting it on every
        comparison would keep it behind the busy tiers for ever and never look
        at it again.
        """
        if tier is self.hand_off:
            self.hand_off = None
        state = self.tiers[tier]
        busy = [s.vtime for t, s in self.tiers.items() if t is not tier and t in self.served and not s.idle]
        state.lift(min(busy) if busy else self.vclock)

    def set_served(self, tiers: Iterable[Tier]) -> None:
        self.served = frozenset(tiers)

    # -- reporting ---------------------------------------------------------
    def shares(self) -> dict[Tier, float]:
        """Fraction of measured slot time each tier received so far."""
        total = sum(s.busy_seconds for s in self.tiers.values())
        return {t: (s.busy_seconds / total if total else 0.0) for t, s in self.tiers.items()}

    def configured_shares(self) -> dict[Tier, float]:
        return configured_shares({t: s.weight for t, s in self.tiers.items()}, self.served)


def configured_shares(weights: Mapping[Tier, float], served: Iterable[Tier]) -> dict[Tier, float]:
    """Each served tier's share of slot time by weight (0 for tiers not served): one rule for every report."""
    served = frozenset(served)
    total = sum(weights[t] for t in served) or 1.0
    return {t: (weights[t] / total if t in served else 0.0) for t in TIERS}
