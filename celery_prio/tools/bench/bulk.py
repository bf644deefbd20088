"""``bulk`` against an ``apply_async`` loop, with the producer's peak memory (``--only bulk``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ...brokers import adapter_for
from .core import Run, broker_kind

SEED_DAY = 5_000_000  # batch items a day on the seed's platform


def bench_bulk(broker: str, plain_n: int, bulk_n: int, logdir: Path, out=print) -> dict[str, Any]:
    """Enqueue rate: apply_async in a loop vs celery_prio.bulk, one producer thread, same app; producer memory."""
    import tracemalloc

    from ...producer.bulk import bulk

    kind = broker_kind(broker)
    run = Run("prio", broker, logdir, 1, max_length={"batch": None})
    try:
        run.publish("batch", 0.0)  # connect and declare outside the timing
        started = time.perf_counter()
        for _ in range(plain_n):
            run.task.apply_async(("batch", 0.0, 0.0), tier="batch")
        plain = plain_n / (time.perf_counter() - started)
        started = time.perf_counter()
        ids = bulk(run.task, (("batch", 0.0, 0.0) for _ in range(bulk_n)), tier="batch", chunk=1000)
        rate = len(ids) / (time.perf_counter() - started)
        # Memory on its own runs: tracemalloc slows Python several times over.
        peaks = {}
        for n in (bulk_n // 20, bulk_n // 5):
            tracemalloc.start()
            bulk(run.task, (("batch", 0.0, 0.0) for _ in range(n)), tier="batch", chunk=1000)
            peaks[n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        depth = adapter_for(run.app)
        try:
            enqueued = depth.depth(f"{run.prefix}.batch")
        finally:
            depth.close()
    finally:
        run.close()
    small, large = sorted(peaks)
    expected = 1 + plain_n + bulk_n + small + large
    out(
        f"bulk publish ({kind}): apply_async loop {plain:.0f}/s ({plain_n:,} tasks); bulk {rate:.0f}/s "
        f"({bulk_n:,} tasks, chunks of 1000), ratio {rate / plain:.1f} (target >= 10"
        + (", and >= 20,000/s on Redis)" if kind == "redis" else ")")
    )
    out(
        f"  producer peak memory (tracemalloc) {peaks[small] / 2**20:.1f} MiB for {small:,} items, "
        f"{peaks[large] / 2**20:.1f} MiB for {large:,} (flat: a chunk at a time); the seed's "
        f"{SEED_DAY:,}-item day enqueues in {SEED_DAY / rate / 60:.1f} min "
        f"(apply_async: {SEED_DAY / plain / 60:.0f} min)"
    )
    if enqueued != expected:
        raise RuntimeError(f"bulk bench: {enqueued} messages in the queue, expected {expected}")
    return {
        "plain_per_s": plain,
        "bulk_per_s": rate,
        "ratio": rate / plain,
        "peak_bytes": peaks,
        "seed_day_minutes": SEED_DAY / rate / 60,
    }
