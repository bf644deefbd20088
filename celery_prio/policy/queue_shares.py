"""Inside one tier: which of its queues (sub-queues) goes next, by run time. Pure.

The same fair-share core as the tier scheduler (``fairshare.py``), one level down: taking a
message from a queue charges it the queue's expected run time divided by its
weight (``prio_subqueue_weights``, default 1), corrected to the measured run
time when the task ends; the queue with the smallest virtual finish tag goes
first. A tenant with a 100,000-task backlog and a tenant with a trickle then
share the tier's slot *time* by weight, not by backlog.

A queue found empty is lifted to the level of the busiest queues (the lowest
virtual time among the queues with work) and marked idle, so it cannot bank
credit while it has nothing to run; a queue seen for the first time starts
at that level too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .fairshare import Flow


@dataclass
class QueueState(Flow):
    """A queue as a flow (``fairshare.Flow``), with its recent waits for the report."""

    waits: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_WINDOW))
    looked_at: float | None = None  # when a fetch last took from it or found it empty (shortest job first)


WAIT_WINDOW = 200  # queue waits kept per queue for its P99


class QueueShares:
    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self.weight_of = weight_of
        self.queues: dict[str, QueueState] = {}
        # ``_level()`` as last computed; None once a vtime or an idle flag may have moved. A fetch reports every
        # empty queue it passed: lifting each by a fresh scan was quadratic in the sub-queues (500 tenants: 80 ms
        # of the worker's CPU per fetch), while lifting a queue already idle moves neither.
        self._level_cache: float | None = None
        self._weights: dict[str, float] = {}

    def _weight(self, name: str) -> float:
        """``weight_of(name)``, remembered: the order of 500 sub-queues asks it 500 times per fetch."""
        weight = self._weights.get(name)
        if weight is None:
            weight = self._weights[name] = self.weight_of(name)
        return weight

    def _level(self, exclude: str | None = None) -> float:
        if exclude is None and self._level_cache is not None:
            return self._level_cache
        busy = [s.vtime for name, s in self.queues.items() if name != exclude and not s.idle]
        level = min(busy) if busy else max((s.vtime for s in self.queues.values()), default=0.0)
        if exclude is None:
            self._level_cache = level
        return level

    def _state(self, name: str) -> QueueState:
        state = self.queues.get(name)
        if state is None:
            state = self.queues[name] = QueueState(vtime=self._level())
            self._level_cache = None  # a new queue at the level: the max over all may be it
        return state

    def order(self, names: Iterable[str], lift_idle: bool = False) -> list[str]:
        """``names`` most deserving first (finish tag, then name: equal queues take turns).

        ``lift_idle``: ``names`` are queues the caller found work in, and it does not report the queues it
        knows are empty on every fetch (Redis's ready index, ``RedisFetchSource.take``). A queue still idle
        (found empty, not taken from since) is then lifted to the level and counted busy again: it comes
        back level with the busy queues, with no credit banked while it had nothing to run.
        """

        def finish(name: str) -> tuple[float, str]:
            state = self.lift_if_idle(name) if lift_idle else self._state(name)
            return state.finish_tag(self._weight(name)), name

        return sorted(names, key=finish)

    def lift_if_idle(self, name: str) -> QueueState:
        """What :meth:`order` with ``lift_idle`` does to each queue: one still idle comes back level, busy."""
        state = self._state(name)
        if state.idle:  # at the level: moves neither the level nor its cache (see ``empty``)
            state.lift(self._level())
            state.idle = False
        return state

    def order_shortest_first(self, names: Iterable[str], now: float, max_wait: float) -> list[str]:
        """Shortest expected run first, bounded: a queue not looked at for ``max_wait`` goes first.

        A queue whose run time is not known yet counts as the shortest, so it
        is tried once and learnt. A long task's queue is put first at least
        every ``max_wait`` seconds, so its head waits at most about that much
        longer than it would in one FIFO queue.
        """
        names = list(names)

        def overdue(name: str) -> bool:
            looked = self._state(name).looked_at
            return looked is None or now - looked >= max_wait

        late = sorted((n for n in names if overdue(n)), key=lambda n: (self._state(n).looked_at or float("-inf"), n))
        rest = [n for n in names if not overdue(n)]
        rest.sort(key=lambda n: (self._state(n).estimate if self._state(n).measured else 0.0, n))
        return late + rest

    def looked_at(self, name: str, now: float) -> None:
        self._state(name).looked_at = now

    def dispatched(self, name: str, now: float | None = None) -> float:
        """A message of ``name`` took a slot (looked at ``now``, when given); returns the charge to pass to
        :meth:`finished`."""
        self._level_cache = None
        state = self._state(name)
        if now is not None:
            state.looked_at = now
        return state.charge(self._weight(name))

    def finished(self, name: str, runtime: float, charge: float) -> None:
        self._level_cache = None
        self._state(name).settle(runtime, charge, self._weight(name))

    def observe_wait(self, name: str, wait: float) -> None:
        self._state(name).waits.append(max(0.0, wait))

    def empty(self, name: str) -> None:
        state = self._state(name)
        if state.idle:  # not among the busy: the level without it is the level, and lifting it moves neither
            state.lift(self._level())
            return
        self._level_cache = None
        state.lift(self._level(exclude=name))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop queues no longer served (their figures go with them)."""
        keep = set(keep)
        for name in [n for n in self.queues if n not in keep]:
            del self.queues[name]
            self._weights.pop(name, None)
        self._level_cache = None
