"""Admission by predicted wait, the arithmetic both brokers share (``prio_max_wait``).

A new call waits for the work ahead of it in its tier: each waiting message
times the fleet's estimate of its run time, over the live slots serving the
tier. Redis does this sum inside its publish script (``guarded_push.lua``);
RabbitMQ's publishers do it from a depth reading and the fleet's record
(``brokers/amqp/admission.py``). Pure functions: no broker, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..tiers import TIERS, Tier

#: How often the workers look for news to share sooner than their usual round: a queue measured for the first
#: time (a cold fleet admits by the cap alone until an estimate is shared), or an estimate that moved by
#: ``NEWS_FACTOR`` or more (a task that got slower or faster).
NEWS_INTERVAL = 0.025
NEWS_FACTOR = 1.5


def slot_share(concurrency: int, tier: Tier, served: Iterable[Tier], weights: Mapping[Tier, float]) -> float:
    """What a worker of ``concurrency`` slots gives ``tier`` while every tier it serves has work: its slots
    split by the tiers' weights (a realtime-only worker gives realtime all of them; one serving every tier
    8/11 of them by default)."""
    served = [t for t in TIERS if t in set(served)]
    if tier not in served:
        return 0.0
    return max(1, concurrency) * weights[tier] / sum(weights[t] for t in served)


def predicted_wait(waiting: Iterable[tuple[int, float | None]], slots: float) -> float | None:
    """Seconds a new call would wait behind ``waiting`` (messages, estimated seconds each; an unknown estimate
    counts nothing) on ``slots`` live slots. None when no slot is known: admitted by the cap alone."""
    if not slots > 0:
        return None
    work = sum(count * each for count, each in waiting if count > 0 and each is not None and each > 0)
    return work / slots


#: Refusals counted by reason and tier (``rejected:realtime``, ``refused_wait:batch``): the names of the
#: broker-wide counters Redis keeps in its stats hash, which RabbitMQ's publishers send to the housekeeper.
REFUSAL_COUNTERS = (
    "rejected:realtime",
    "rejected:batch",
    "rejected:offline",
    "refused_wait:realtime",
    "refused_wait:batch",
    "refused_wait:offline",
)
#: The most one message may add to a counter (anyone can publish to a queue).
MAX_COUNT = 10**9


def refusal_counts(raw: object) -> dict[str, int]:
    """The refusal counters in ``raw`` (decoded JSON): known names, whole numbers in [0, MAX_COUNT]."""
    if not isinstance(raw, dict):
        return {}
    return {
        k: v
        for k, v in raw.items()
        if k in REFUSAL_COUNTERS and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT
    }


@dataclass
class FleetRecord:
    """What the fleet's workers measured, summed: live slots per tier and run-time estimates per queue; in the
    fleet's record also the refusals its publishers counted (RabbitMQ)."""

    slots: dict[Tier, float] = field(default_factory=dict)
    estimates: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "slots": {t.label: round(v, 3) for t, v in self.slots.items()},
            "estimates": self.estimates,
        }
        if self.counters:
            out["counters"] = self.counters
        return out

    @classmethod
    def from_json(cls, data: object) -> FleetRecord | None:
        """The record in ``data`` (a decoded JSON body), or None if it is not one: anyone can publish to a queue,
        so a figure that is not a finite, non-negative number is dropped, and so is a record without slots."""
        if not isinstance(data, dict):
            return None
        raw = data.get("slots")
        raw = raw if isinstance(raw, dict) else {}
        slots = {t: v for t in TIERS if (v := _figure(raw.get(t.label))) is not None}
        raw = data.get("estimates")
        estimates = (
            {k: v for k, e in raw.items() if isinstance(k, str) and (v := _figure(e)) is not None}
            if isinstance(raw, dict)
            else {}
        )
        return cls(slots, estimates, refusal_counts(data.get("counters"))) if slots else None


@dataclass
class Backlog:
    """The work ahead of a call to one queue, as a publisher sees it between two depth readings (RabbitMQ's,
    at most 0.1 s apart): a fluid queue. Read from the broker (messages times their estimates), drained since
    at the rate of the tier's slots, the publisher's admitted calls added as they go. Without the drain, an
    aging reading and a burst of the publisher's own calls would count work the slots have already run:
    refusals the tier has room for, and its slots left to lower tiers."""

    read_at: float
    messages: int  # waiting at the reading
    work: float  # seconds of work left, as of ``at``
    at: float
    admitted: int = 0  # calls this process added since the reading

    def drained(self, now: float, slots: float) -> float:
        """The work left now (seconds), the slots having run ``slots`` seconds of it per second."""
        self.work = max(0.0, self.work - slots * (now - self.at))
        self.at = now
        return self.work


def _figure(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def merge_reports(reports: Iterable[FleetRecord]) -> FleetRecord:
    """The fleet's record from its workers' reports (each a ``FleetRecord`` of one worker): slots summed per
    tier, each queue's estimate the mean of the workers that measured it."""
    slots = dict.fromkeys(TIERS, 0.0)
    sums: dict[str, list[float]] = {}
    for report in reports:
        for tier, share in report.slots.items():
            slots[tier] += share
        for name, each in report.estimates.items():
            sums.setdefault(name, []).append(each)
    return FleetRecord(slots, {name: sum(v) / len(v) for name, v in sums.items()})


def has_news(sent: FleetRecord | None, now: FleetRecord) -> bool:
    """``now`` measured a queue ``sent`` had no estimate of, or moved one by ``NEWS_FACTOR`` or more (a task
    that got slower or faster): worth sending before ``REPORT_INTERVAL``."""
    if sent is None:
        return bool(now.estimates)
    for name, each in now.estimates.items():
        before = sent.estimates.get(name)
        if before is None or each > before * NEWS_FACTOR or each * NEWS_FACTOR < before:
            return True
    return False


__all__ = [
    "NEWS_FACTOR",
    "NEWS_INTERVAL",
    "REFUSAL_COUNTERS",
    "Backlog",
    "FleetRecord",
    "has_news",
    "merge_reports",
    "predicted_wait",
    "refusal_counts",
    "slot_share",
]
