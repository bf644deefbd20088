"""The demand signal: how many worker slots each tier needs now. Pure.

An autoscaler that scales Celery on queue length is misled by prefetch:
tasks a worker reserved are neither in the queue nor running. celery-prio
holds nothing in workers, so waiting (in the broker) plus running (in a
slot) is all the work there is, and a tier needs

    running + ceil(waiting * run_time_estimate / target)

slots: the ones busy now, plus enough to drain what waits within the tier's
target (``prio_demand_target``: realtime 0.2 s, its P99 goal; batch 300 s,
"minutes are fine"; offline 3600 s, "hours are fine"). A tier whose run time
is not known yet (no worker finished one of its tasks) counts one slot per
waiting task up to one, so work waiting on an empty pool asks for a first
worker. Divide by a pool's slots per replica for a replica count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def slots_needed(waiting: int, running: int, estimate_s: float | None, target_s: float) -> int:
    """Slots a tier needs now (``estimate_s`` None: run time unknown)."""
    waiting, running = max(int(waiting), 0), max(int(running), 0)
    if waiting == 0:
        return running
    if estimate_s is None:
        return running + 1
    return running + max(1, math.ceil(waiting * max(estimate_s, 0.0) / target_s))


def fleet_estimate(samples: Iterable[tuple[int, float]]) -> float | None:
    """The fleet's run-time estimate of a tier from ``(tasks finished, estimate)`` per worker.

    Weighted by what each worker has finished; None when none has finished one.
    """
    total = weighted = 0.0
    for finished, estimate in samples:
        if finished > 0 and estimate >= 0:
            total += finished
            weighted += finished * estimate
    return weighted / total if total else None
