"""What a worker learns of the fleet and the broker on its own loop: new sub-queues, queues nobody serves,
and broker-wide figures for its report. Each runs as a housekeeping job (``housekeeping.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from celery.utils.log import get_logger

from ..brokers import BrokerFetchSource, BrokerFigures
from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .unserved import EveryMinute, UnservedTracker, app_queues

logger = get_logger(__name__)


class FleetWatch:
    """Discovery of sub-queues into ``served`` (their one owner), the unserved-queue check, the figures."""

    def __init__(
        self, source: BrokerFetchSource, served: ServedQueues, settings: PrioSettings, idle: Callable[[], bool]
    ) -> None:
        self.source, self.served, self.settings = source, served, settings
        self.idle = idle  # every queue this worker serves was found empty and nothing runs
        self.figures = BrokerFigures()
        self._wanted = True  # a report was read since the figures were (the first read is at start)
        self.unserved = UnservedTracker()
        self._unserved_log = EveryMinute()
        self._discovery_log = EveryMinute()

    def discover_subqueues(self) -> None:
        names = self.source.discover_subqueues()
        if names is not None and names != self.served.discovered:
            self.served.set_discovered(names)
        problem = self.source.discovery_problem
        if self._discovery_log.due(time.monotonic(), problem is not None):
            logger.warning(
                "celery-prio: this worker cannot discover new sub-queues of %s: %s (queues it found so far are "
                "still served; new tenants' and per-call realtime tasks' queues wait until it can)",
                ", ".join(t.label for t in self.served.tiers),
                problem,
            )

    def check_unserved(self) -> None:
        """Queues with messages whose tier no live worker serves; only tiers this worker does not serve
        need a look (it serves the others itself), so a worker that serves every tier asks nothing."""
        now = time.monotonic()
        missing = [t for t in TIERS if t not in self.served.tiers]
        depths: list[tuple[str, Tier, int]] = []
        serving: dict[Tier, int] | None = {}
        if missing:
            serving = self.source.fleet_serving()
            if serving is None:
                return  # the broker cannot say now: keep the last figures
            queues = app_queues(self.settings, self.served.discovered, missing)
            counts = self.source.queue_depths([name for name, _ in queues])
            depths = [(name, tier, n) for (name, tier), n in zip(queues, counts, strict=True)]
        rows = self.unserved.update(now, depths, serving)
        if self._unserved_log.due(now, bool(rows)):
            logger.warning(
                "celery-prio: messages wait where no live worker serves their tier: %s",
                "; ".join(f"{r.queue} ({r.depth} waiting, {r.seconds:.0f} s, tier {r.tier})" for r in rows),
            )

    def wanted(self) -> None:
        """Someone read the report (any thread): the figures are read again at the next ``read_figures``."""
        self._wanted = True

    def read_figures(self) -> None:
        """Broker-wide figures for the report, read only when a report was read since the last time: a fleet
        nobody watches asks its broker nothing for them (per worker, a depth read is one call per queue it
        serves; on a busy fleet of many workers, read every few seconds, they were a good share of RabbitMQ's
        work per task). While the worker is idle (every queue it serves found empty, waiting on the broker)
        their depths are known to be zero and are not asked: an idle worker reads only the counters and the
        dead letters."""
        if self._wanted:
            self._wanted = False
            self.figures = self.source.broker_figures(time.monotonic(), idle=self.idle())

    def fresh_figures(self, within: float) -> BrokerFigures:
        """The figures, read again first if older than ``within`` seconds (on the worker's loop only)."""
        if time.monotonic() - self.figures.read_at > within:
            self._wanted = True
            self.read_figures()
        return self.figures


__all__ = ["FleetWatch"]
