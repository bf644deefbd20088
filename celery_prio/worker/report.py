"""The worker report: one typed object, built in one place.

It feeds ``inspect prio_stats`` and ``inspect stats`` (as a dict: JSON goes
over the wire), the Prometheus exporter (read as attributes), and
``prio status`` (which turns the replies back into reports with
:meth:`WorkerReport.from_dict`). Building it makes no broker call: broker-wide
figures come from :class:`~celery_prio.brokers.base.BrokerFigures`, read
earlier on the worker's own loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..brokers.base import BrokerFigures
from ..policy.scheduler import TierScheduler
from ..policy.served import ServedQueues
from ..tiers import TIERS, Tier
from .stats import WorkerStats, percentile
from .unserved import Unserved


def fmt(value: Any, pattern: str = "{}") -> str:
    """``pattern`` filled with ``value``, or ``-`` when there is none (tables and rows for people)."""
    return "-" if value is None else pattern.format(value)


class _FromReply:
    """Built back from an ``inspect`` reply: the fields it knows, whatever else the reply holds."""

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data if isinstance(data, dict) else {}).items() if k in known})


@dataclass
class TierReport(_FromReply):
    queues: list[str] = field(default_factory=list)
    dispatched: int = 0
    finished: int = 0
    running: int = 0
    busy_seconds: float = 0.0
    slot_time_share: float = 0.0
    configured_share: float = 0.0
    runtime_estimate_s: float = 0.0
    oldest_wait_s: float | None = None
    depth: int | None = None  # waiting in the queues this worker serves (read every 2 s)
    # Broker-wide counters (Redis keeps them; None on RabbitMQ).
    promoted: int | None = None
    boosted: int | None = None  # lifted out of the tier by celery_prio.boost
    rejected: int | None = None  # refused at the cap (prio_max_length)
    refused_wait: int | None = None  # refused for a predicted wait over prio_max_wait
    dropped: int | None = None
    dead_lettered: int | None = None
    wait_p50_ms: float | None = None
    wait_p99_ms: float | None = None
    wait_max_s: float = 0.0
    run_p50_ms: float | None = None
    run_p99_ms: float | None = None
    promoted_seen: int = 0
    boosted_seen: int = 0  # tasks this worker ran that a boost had lifted into the tier
    expired: int = 0  # calls this worker found past their deadline: marked expired, not run
    answered: int = 0  # realtime calls this worker ran whose publish time it knew
    on_time: int = 0  # of those, answered within prio_realtime_target (goodput)
    # GPU time slices: runs of sliced tasks that gave their slot back, and the tier's slice length.
    yields: int = 0
    slice_s: float | None = None
    # Batched tasks (celery_prio.Batch): {"runs", "calls", "mean", "max", "failed"}; None before the first.
    batches: dict[str, float] | None = None


@dataclass
class SubqueueReport(_FromReply):
    """One queue inside a tier (the tier's own queue or a sub-queue), or ``other``: the rest together."""

    tier: str = ""
    dispatched: int = 0
    busy_seconds: float = 0.0
    share_of_tier: float = 0.0  # of the tier's measured slot time on this worker
    wait_p99_ms: float | None = None


#: Sub-queues reported by name (most slot time first); the rest are summed under ``other``.
TOP_SUBQUEUES = 10


@dataclass
class WorkerReport:
    concurrency: int = 0
    reserve: int = 0
    scheduler: str = "time"
    broker_calls: int = 0
    polled_queues: list[str] = field(default_factory=list)
    stale_skipped: int = 0  # originals of boosted tasks (RabbitMQ) this worker acked unrun
    held: int = 0  # messages pushed to this worker, waiting for a slot (RabbitMQ, prio_fetch="consume")
    # Queues with messages whose tier no live worker serves ({queue: {tier, depth, seconds}}), and why this
    # worker cannot find new sub-queues (None: it can).
    unserved: dict[str, dict[str, Any]] = field(default_factory=dict)
    discovery_problem: str | None = None
    # The dead-letter list's length, and how many the cap (prio_dead_letter_max) dropped (Redis; None elsewhere).
    dead_letters: int | None = None
    dead_dropped: int | None = None
    gpus: list[str] = field(default_factory=list)  # the GPUs its pool processes are pinned to (--prio-gpus)
    tiers: dict[str, TierReport] = field(default_factory=dict)
    subqueues: dict[str, SubqueueReport] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> WorkerReport | None:
        """A report from an ``inspect`` reply; None for a reply that is not one (another consumer, an error)."""
        if not isinstance(data, dict) or not isinstance(data.get("tiers"), dict):
            return None
        known = {f.name for f in fields(cls)} - {"tiers", "subqueues"}
        report = cls(**{k: v for k, v in data.items() if k in known})
        report.tiers = {t.label: TierReport.from_dict(data["tiers"].get(t.label)) for t in TIERS}
        subqueues = data.get("subqueues")
        if isinstance(subqueues, dict):
            report.subqueues = {str(k): SubqueueReport.from_dict(v) for k, v in subqueues.items()}
        return report


def build_report(
    scheduler: TierScheduler,
    stats: WorkerStats,
    served: ServedQueues,
    broker: BrokerFigures,
    broker_calls: int,
    now: float,
    yields: Mapping[Tier, int] | None = None,
    slice_lengths: Mapping[Tier, float | None] | None = None,
    stale_skipped: int = 0,
    held: int = 0,
    unserved: Iterable[Unserved] = (),
    discovery_problem: str | None = None,
) -> WorkerReport:
    shares = scheduler.shares()
    configured = scheduler.configured_shares()
    counters = broker.counters
    tiers = {}
    for tier, st in scheduler.tiers.items():
        if tier in broker.oldest_age:
            age = broker.oldest_age[tier]
            oldest = None if age is None else age + max(0.0, now - broker.read_at)
        else:
            oldest = stats.oldest_wait(tier, now)

        def counted(name: str, tier_label: str = tier.label) -> int | None:
            key = f"{name}:{tier_label}"
            if counters is None or (broker.kept is not None and key not in broker.kept):
                return None  # not kept by this broker: unknown, not zero
            return counters.get(key, 0)

        tiers[tier.label] = TierReport(
            queues=list(served.by_tier[tier]),
            dispatched=st.dispatched,
            finished=st.finished,
            running=st.running,
            busy_seconds=round(st.busy_seconds, 3),
            slot_time_share=round(shares[tier], 4),
            configured_share=round(configured[tier], 4),
            runtime_estimate_s=round(st.estimate, 4),
            oldest_wait_s=None if oldest is None else round(oldest, 3),
            depth=broker.depth.get(tier),
            promoted=counted("promoted"),
            boosted=counted("boosted"),
            rejected=counted("rejected"),
            refused_wait=counted("refused_wait"),
            dropped=counted("dropped"),
            dead_lettered=counted("dead_lettered"),
            yields=(yields or {}).get(tier, 0),
            slice_s=(slice_lengths or {}).get(tier),
            **stats.summary(tier),
        )
    return WorkerReport(
        subqueues=subqueue_reports(served),
        concurrency=scheduler.concurrency,
        reserve=scheduler.reserve,
        scheduler=scheduler.mode,
        broker_calls=broker_calls,
        polled_queues=served.all_names(),
        stale_skipped=stale_skipped,
        held=held,
        unserved={r.queue: r.as_dict() for r in unserved},
        discovery_problem=discovery_problem,
        dead_letters=broker.dead_letters,
        dead_dropped=None if counters is None else counters.get("dead_dropped:all", 0),
        tiers=tiers,
    )


def subqueue_reports(served: ServedQueues, top: int = TOP_SUBQUEUES) -> dict[str, SubqueueReport]:
    """The busiest queues inside the tiers by name, the rest as ``other`` (bounded label cardinality)."""
    states = served.queue_states()
    tier_busy: dict[Tier, float] = {}
    for tier, _, state in states:
        tier_busy[tier] = tier_busy.get(tier, 0.0) + state.busy_seconds
    states.sort(key=lambda row: (-row[2].busy_seconds, -row[2].dispatched, row[1]))
    out: dict[str, SubqueueReport] = {}
    other = SubqueueReport(tier="")
    for i, (tier, name, state) in enumerate(states):
        share = state.busy_seconds / tier_busy[tier] if tier_busy[tier] else 0.0
        if i < top:
            p99 = percentile(list(state.waits), 99)
            out[name] = SubqueueReport(
                tier=tier.label,
                dispatched=state.dispatched,
                busy_seconds=round(state.busy_seconds, 3),
                share_of_tier=round(share, 4),
                wait_p99_ms=None if p99 is None else round(p99 * 1000, 1),
            )
        else:
            other.dispatched += state.dispatched
            other.busy_seconds = round(other.busy_seconds + state.busy_seconds, 3)
    if len(states) > top:
        out["other"] = other
    return out


def readable_rows(report: WorkerReport) -> dict[str, str]:
    """One line per tier for people (Flower's worker page): ``"prio realtime": "wait p99 12 ms · share ..."``.

    ``inspect prio_stats`` keeps the full, machine-readable report.
    """

    rows = {}
    for label, row in report.tiers.items():
        parts = [
            f"wait p99 {fmt(row.wait_p99_ms, '{:.0f}')} ms",
            f"share {row.slot_time_share * 100:.0f} % of {row.configured_share * 100:.0f} %",
            f"depth {fmt(row.depth)}",
            f"oldest {fmt(row.oldest_wait_s, '{:.1f}')} s",
            f"running {row.running}",
            f"done {row.finished}",
        ]
        if row.yields:
            parts.append(f"yields {row.yields}")
        if row.promoted:
            parts.append(f"promoted {row.promoted}")
        if row.boosted:  # lifted out of this tier by celery_prio.boost (broker-wide, Redis)
            parts.append(f"boosted out {row.boosted}")
        if row.rejected or row.refused_wait:
            parts.append(f"refused {row.rejected or 0} at the cap, {row.refused_wait or 0} over the wait budget")
        if row.expired:
            parts.append(f"expired {row.expired}")
        if row.answered:
            parts.append(f"on time {row.on_time} of {row.answered}")
        if row.boosted_seen:  # run here after a boost lifted them into this tier
            parts.append(f"boosted in {row.boosted_seen}")
        if row.batches:
            parts.append(f"batches {row.batches['runs']} of {row.batches['mean']:.1f} (max {row.batches['max']})")
        rows[f"prio {label}"] = " · ".join(parts)
    for queue, row in report.unserved.items():
        rows[f"prio unserved {queue}"] = (
            f"{row['depth']} waiting for {row['seconds']:.0f} s: no live worker serves {row['tier']}"
        )
    if report.discovery_problem:
        rows["prio discovery"] = f"failing: {report.discovery_problem}"
    return rows
