"""``prio_scheduler = "count"``: weighted round robin by dispatches, for comparison only.

Each dispatch is charged 1 whatever its run time, and offline's floor is
``min_share`` dispatches per 100 (a credit, full at 100). With 20 ms realtime
tasks and 400 ms offline tasks it gives realtime far less than 8/11 of the
time: ``celery-prio bench`` and ``prio simulate --vs scheduler=count`` show
by how much. Kept out of :class:`~celery_prio.policy.scheduler.TierScheduler`
so that the default's hot path has no branch for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..settings.table import SCHEDULER_MODES
from ..tiers import Tier
from .scheduler import TierScheduler, TierState


@dataclass
class CountScheduler(TierScheduler):
    mode: ClassVar[str] = "count"
    corrects_charges: ClassVar[bool] = False
    #: Offline's floor: credit in "per 100 dispatches" units, full at 100 (the first offline task need not wait).
    offline_credit: float = field(init=False, default=100.0)

    def _cost(self, state: TierState) -> float:
        return 1.0

    def _apply_floor(self, eff: dict[Tier, float], busy: list[Tier]) -> None:
        """The count floor is a credit (``_ranking``), not a weight."""

    def _ranking(
        self, headroom: bool, overrun: Mapping[Tier, float] | None = None, busy_now: Iterable[Tier] = ()
    ) -> list[Tier]:
        candidates = super()._ranking(headroom, overrun, busy_now)
        if (
            self.min_share > 0
            and Tier.OFFLINE in candidates
            and self.offline_credit >= 100.0
            and not self.tiers[Tier.OFFLINE].idle
        ):
            candidates.remove(Tier.OFFLINE)
            candidates.insert(0, Tier.OFFLINE)
        return candidates

    def dispatched(self, tier: Tier) -> float:
        charge = super().dispatched(tier)
        if self.min_share > 0 and Tier.OFFLINE in self.served:
            credit = self.offline_credit + self.min_share
            if tier is Tier.OFFLINE:
                credit -= 100.0
            # Capped so that an idle offline tier cannot save up a burst.
            self.offline_credit = min(100.0, max(0.0, credit))
        return charge


def scheduler_for(mode: str, *args: Any, **options: Any) -> TierScheduler:
    """The scheduler ``prio_scheduler`` names: ``"time"`` (shares of slot time) or ``"count"`` (comparison)."""
    if mode not in SCHEDULER_MODES:
        raise ValueError(f"scheduler mode must be one of {SCHEDULER_MODES}, got {mode!r}")
    return (CountScheduler if mode == "count" else TierScheduler)(*args, **options)


__all__ = ["CountScheduler", "scheduler_for"]
