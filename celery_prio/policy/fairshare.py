"""The fair-share core: flows that share slot time by weight, in virtual time. Pure.

One rule serves both levels of scheduling: the tiers of a worker
(``scheduler.py``) and the queues inside a tier (``queue_shares.py``). A flow
carries a virtual time. Taking a slot charges it its expected run time
divided by its weight; when the run ends the charge is corrected to the
measured run time (start-time fair queueing with a per-flow run-time
estimate). The flow with the smallest virtual finish tag goes next. A flow
found empty is lifted to a level the caller chooses (where the busy flows
are) and marked idle, so it cannot bank credit while it has nothing to run.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_ALPHA = 0.2  # weight of the newest run time in a flow's estimate
DEFAULT_ESTIMATE = 0.1  # seconds assumed for a flow until one of its runs finished


@dataclass
class Flow:
    """One flow's figures: its virtual time and what it knows of its run times."""

    vtime: float = 0.0
    estimate: float = DEFAULT_ESTIMATE
    measured: bool = False
    idle: bool = False
    dispatched: int = 0
    busy_seconds: float = 0.0

    def finish_tag(self, weight: float, cost: float | None = None) -> float:
        """Where this flow's next run would end in virtual time (``cost``: the estimate unless given)."""
        return self.vtime + (self.estimate if cost is None else cost) / weight

    def charge(self, weight: float, cost: float | None = None) -> float:
        """A run of this flow took a slot: charged its expected ``cost``; returns the charge."""
        cost = self.estimate if cost is None else cost
        self.idle = False
        self.dispatched += 1
        self.vtime += cost / weight
        return cost

    def settle(self, runtime: float, charge: float, weight: float, correct: bool = True) -> None:
        """A run charged ``charge`` ended after ``runtime`` seconds: correct the charge and learn the run time.

        ``correct=False`` (dispatch counting) keeps the charge and the estimate as they are.
        """
        runtime = max(0.0, runtime)
        self.busy_seconds += runtime
        if not correct:
            return
        self.vtime += (runtime - charge) / weight
        if self.measured:
            self.estimate += EWMA_ALPHA * (runtime - self.estimate)
        else:
            self.estimate, self.measured = runtime, True

    def lift(self, level: float) -> None:
        """Found empty: no credit banked below ``level``, and idle until a run takes a slot again."""
        self.vtime = max(self.vtime, level)
        self.idle = True
