"""Per-tier figures a worker keeps about what it fetched and ran. Pure, cheap.

The hot path is one ``observe_fetch`` per dispatched message (a header read
and a deque append) and one ``observe_run`` per finished task; percentiles
are computed only when someone asks (``inspect stats``, ``/metrics``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from ..tiers import TIERS, Tier

WINDOW = 2048  # recent samples kept per tier for percentiles
#: Histogram bucket bounds (seconds), Prometheus-style, for queue wait and run time.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200)
#: Bucket bounds (calls) for batch sizes (``celery_prio.Batch``).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = BUCKETS
    counts: list[int] = field(default_factory=list)  # one per bound, and the last for +Inf
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        counts = self.counts or [0] * (len(self.bounds) + 1)
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class TierFigures:
    wait_hist: Histogram = field(default_factory=Histogram)
    run_hist: Histogram = field(default_factory=Histogram)
    waits: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    runtimes: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    promoted_seen: int = 0  # fetched messages that had been promoted into this tier
    boosted_seen: int = 0  # fetched messages that celery_prio.boost had lifted into this tier
    expired: int = 0  # calls past their deadline when fetched: marked expired, not run
    answered: int = 0  # realtime calls that ran, publish stamp known (what ``on_time`` is out of)
    on_time: int = 0  # of those, answered within prio_realtime_target, publish to end of run (goodput)
    max_wait: float = 0.0
    head_wait: float | None = None  # wait of the last message taken from the head
    head_seen_at: float | None = None
    batch_hist: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))  # calls per batch run
    batch_failed: int = 0  # calls of batches that failed
    batch_max: int = 0


class WorkerStats:
    def __init__(self, target: float | None = None) -> None:
        self.tiers = {t: TierFigures() for t in TIERS}
        self.target = target  # realtime's latency target (prio_realtime_target): goodput counts against it

    def observe_fetch(self, tier: Tier, wait: float | None, promoted: bool, now: float) -> None:
        figures = self.tiers[tier]
        if promoted:
            figures.promoted_seen += 1
        if wait is not None:
            wait = max(0.0, wait)
            figures.waits.append(wait)
            figures.wait_hist.observe(wait)
            figures.max_wait = max(figures.max_wait, wait)
            figures.head_wait, figures.head_seen_at = wait, now

    def observe_expired(self, tier: Tier) -> None:
        self.tiers[tier].expired += 1

    def observe_boosted(self, tier: Tier) -> None:
        self.tiers[tier].boosted_seen += 1

    def observe_run(self, tier: Tier, seconds: float, waited: float | None = None) -> None:
        """A run ended after ``seconds``, ``waited`` seconds after its publish (None: unknown)."""
        figures = self.tiers[tier]
        figures.runtimes.append(seconds)
        figures.run_hist.observe(seconds)
        if tier is Tier.REALTIME and waited is not None and self.target is not None:
            figures.answered += 1
            figures.on_time += max(0.0, waited) + seconds <= self.target

    def observe_batch(self, tier: Tier, size: int, failed: int) -> None:
        """A batch of ``size`` calls ran as one (``failed`` of them failed)."""
        figures = self.tiers[tier]
        figures.batch_hist.observe(size)
        figures.batch_failed += failed
        figures.batch_max = max(figures.batch_max, size)

    def observe_empty(self, tier: Tier) -> None:
        self.tiers[tier].head_wait = self.tiers[tier].head_seen_at = None

    def oldest_wait(self, tier: Tier, now: float) -> float | None:
        """Estimated age of the oldest waiting message, from what was last taken off the head."""
        f = self.tiers[tier]
        if f.head_wait is None or f.head_seen_at is None:
            return None
        return f.head_wait + (now - f.head_seen_at)

    def summary(self, tier: Tier) -> dict[str, float | int | None]:
        f = self.tiers[tier]
        waits, runs = list(f.waits), list(f.runtimes)

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 1)

        return {
            "wait_p50_ms": ms(percentile(waits, 50)),
            "wait_p99_ms": ms(percentile(waits, 99)),
            "wait_max_s": round(f.max_wait, 3),
            "run_p50_ms": ms(percentile(runs, 50)),
            "run_p99_ms": ms(percentile(runs, 99)),
            "promoted_seen": f.promoted_seen,
            "boosted_seen": f.boosted_seen,
            "expired": f.expired,
            "answered": f.answered,
            "on_time": f.on_time,
            "batches": None
            if not f.batch_hist.n
            else {
                "runs": f.batch_hist.n,
                "calls": int(f.batch_hist.total),
                "mean": round(f.batch_hist.total / f.batch_hist.n, 2),
                "max": f.batch_max,
                "failed": f.batch_failed,
            },
        }
