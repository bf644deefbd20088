"""The fleet's view of the tiers: broker depths plus every worker's report, and the demand signal.

``prio status`` prints it, ``prio exporter`` serves it to Prometheus (and so
to an autoscaler such as KEDA). Correct with any number of workers: depths
are read once from the broker, running tasks and run-time estimates are
summed or weighted over the workers that answer ``inspect prio_stats``.
"""

from __future__ import annotations

from ..policy.demand import fleet_estimate, slots_needed
from ..policy.scheduler import configured_shares
from ..runtime import runtime_of
from ..tiers import TIERS
from ..worker.control import collect_prio_stats
from ..worker.report import WorkerReport
from ..worker.unserved import app_queues, unserved_now


def cluster_status(app, settings, adapter) -> dict:
    """Per tier: broker depth, plus the workers' reports summed (inspect prio_stats)."""
    replies = collect_prio_stats(app, timeout=1.0)
    reports = {name: r for name, r in ((n, WorkerReport.from_dict(v)) for n, v in replies.items()) if r is not None}
    total_busy = sum(t.busy_seconds for r in reports.values() for t in r.tiers.values())
    served = [t for t in TIERS if any(r.tiers[t.label].queues for r in reports.values())] or list(TIERS)
    configured = configured_shares(settings.weights, served)
    rows = {}
    for tier in TIERS:
        per_worker = [r.tiers[tier.label] for r in reports.values()]

        def worst(attr, rows_=per_worker):
            values = [getattr(r, attr) for r in rows_ if getattr(r, attr) is not None]
            return max(values) if values else None

        busy = sum(r.busy_seconds for r in per_worker)
        depth = adapter.tier_depth(settings, tier)
        lane = settings.front_lanes().get(tier)
        waiting = depth + (adapter.depth(lane) if lane else 0)  # promoted and boosted tasks wait there too
        running = sum(r.running for r in per_worker)
        estimate = fleet_estimate((r.finished, r.runtime_estimate_s) for r in per_worker)
        rows[tier.label] = {
            "queue": settings.queue_name(tier),
            "depth": depth,
            "waiting": waiting,
            "max_length": settings.max_length[tier],
            "workers": sum(1 for r in per_worker if r.queues),
            "dispatched": sum(r.dispatched for r in per_worker),
            "running": running,
            "runtime_estimate_s": None if estimate is None else round(estimate, 4),
            "demand_slots": slots_needed(waiting, running, estimate, settings.demand_target[tier]),
            "oldest_wait_s": worst("oldest_wait_s"),
            "wait_p99_ms": worst("wait_p99_ms"),
            "slot_time_share": round(busy / total_busy, 4) if total_busy else None,
            "configured_share": round(configured[tier], 4),
            # Broker-wide counters: every worker reports the same figure, so the largest (the freshest).
            "promoted": worst("promoted"),
            "boosted": worst("boosted"),
            "boosted_seen": sum(r.boosted_seen for r in per_worker),
            "rejected": worst("rejected"),
            "refused_wait": worst("refused_wait"),
            "expired": sum(r.expired for r in per_worker),
            "answered": sum(r.answered for r in per_worker),
            "on_time": sum(r.on_time for r in per_worker),
            "dropped": worst("dropped"),
            "dead_lettered": worst("dead_lettered"),
            "yields": sum(r.yields for r in per_worker),
            "slice_s": settings.slice[tier],
        }
    return {
        "tiers": rows,
        "subqueues": subqueue_rows(reports.values(), adapter),
        "unserved": unserved_rows(settings, adapter),
        "legacy": legacy_rows(app, adapter),
        "discovery_problems": {name: r.discovery_problem for name, r in reports.items() if r.discovery_problem},
        "dead": adapter.depth(settings.dead_letter_queue),
        "workers": sorted(reports),
        "worker_gpus": {name: r.gpus for name, r in sorted(reports.items()) if r.gpus},
    }


def unserved_rows(settings, adapter) -> dict:
    """Queues holding messages while no live worker serves their tier (read from the broker, now)."""
    serving = adapter.serving(settings)
    if serving is None:
        return {}
    queues = app_queues(settings, adapter.subqueues(settings))
    depths = adapter.depths([name for name, _ in queues])
    found = unserved_now([(name, tier, n) for (name, tier), n in zip(queues, depths, strict=True)], serving)
    return {name: {"tier": tier.label, "depth": depth} for name, tier, depth in found}


def legacy_rows(app, adapter) -> dict:
    """The queues producers without celery-prio publish to (``prio_legacy_queues``) that hold messages now."""
    runtime = runtime_of(app)
    names = list(runtime.legacy_queues) if runtime is not None else []
    depths = adapter.depths(names) if names else []
    return {name: {"depth": depth} for name, depth in zip(names, depths, strict=True) if depth}


def subqueue_rows(reports, adapter) -> dict:
    """The queues inside the tiers that the workers report (their busiest, and ``other``), summed over workers."""
    rows: dict = {}
    for report in reports:
        for name, sub in report.subqueues.items():
            row = rows.setdefault(name, {"tier": sub.tier, "dispatched": 0, "busy_seconds": 0.0, "wait_p99_ms": None})
            row["dispatched"] += sub.dispatched
            row["busy_seconds"] = round(row["busy_seconds"] + sub.busy_seconds, 3)
            if sub.wait_p99_ms is not None:
                row["wait_p99_ms"] = max(row["wait_p99_ms"] or 0.0, sub.wait_p99_ms)
    tier_busy: dict = {}
    for row in rows.values():
        tier_busy[row["tier"]] = tier_busy.get(row["tier"], 0.0) + row["busy_seconds"]
    for name, row in rows.items():
        busy = tier_busy.get(row["tier"]) or 0.0
        row["share_of_tier"] = round(row["busy_seconds"] / busy, 4) if busy else None
        row["depth"] = None if name == "other" else adapter.depth(name)
    # A queue that was never used and holds nothing says nothing (realtime's shortest-first queue of every task a
    # worker registered, Celery's own built-ins among them, is served from the start).
    return {name: row for name, row in rows.items() if row["dispatched"] or row["depth"]}
