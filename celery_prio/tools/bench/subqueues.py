"""Tenants in sub-queues against one shared queue, and shortest job first against FIFO (``--only subqueues|sjf``)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from .core import Run, broker_kind, percentile, poisson_streams


def run_tenants(broker: str, duration: float, logdir: Path, subqueues: bool, flood: int = 20_000) -> dict[str, Any]:
    """Batch tier: tenant A floods it at once, tenant B trickles 2/s. B's queue wait, with or without sub-queues."""
    from ...producer.bulk import bulk

    run = Run("prio", broker, logdir, 4, max_length={"batch": None})
    try:
        sub = {"subqueue": "tenant-a"} if subqueues else {}
        bulk(run.task, (("tenant-a", 0.0, 0.05) for _ in range(flood)), tier="batch", **sub)
        run.start_worker()
        t0 = time.time()
        sent = []

        def trickle() -> None:
            stamp = time.time()
            run.task.apply_async(
                ("tenant-b", stamp, 0.05), tier="batch", **({"subqueue": "tenant-b"} if subqueues else {})
            )
            sent.append(stamp)

        poisson_streams({"b": (2.0, trickle)}, t0, t0 + duration, random.Random(3))
        time.sleep(1.0)
        cutoff, records = time.time(), run.read()
    finally:
        run.close()
    started = {s: start for tier, s, start, _ in records if tier == "tenant-b"}
    waits = [started[s] - s if s in started else cutoff - s for s in sent]  # not started: waited until the cut-off
    return {
        "b_sent": len(sent),
        "b_started": len(started),
        "b_p50_wait_s": percentile(waits, 50),
        "b_p99_wait_s": percentile(waits, 99),
    }


def bench_subqueues(broker: str, duration: float, logdir: Path, out=print) -> dict[str, Any]:
    kind = broker_kind(broker)
    shared = run_tenants(broker, duration, logdir, subqueues=False)
    split = run_tenants(broker, duration, logdir, subqueues=True)
    out(
        f"\n== {kind}: tenants in the batch tier, {duration:.0f} s: A publishes 20,000 x 50 ms at once, B 2/s "
        f"(concurrency 4): B's queue wait P50/P99 {shared['b_p50_wait_s']:.2f}/{shared['b_p99_wait_s']:.2f} s in one "
        f"shared queue ({shared['b_started']}/{shared['b_sent']} started), {split['b_p50_wait_s']:.2f}/"
        f"{split['b_p99_wait_s']:.2f} s with a sub-queue per tenant ({split['b_started']}/{split['b_sent']} "
        f"started; target P99 <= 1 s)"
    )
    return {"shared_queue": shared, "subqueues": split}


def run_sjf(broker: str, duration: float, logdir: Path, sjf: bool) -> dict[str, Any]:
    """Realtime only at ~80 % load: 20 ms tasks (40/s) and 500 ms tasks (4.8/s) on 4 slots."""
    run = Run("prio", broker, logdir, 4, sjf=sjf, reserve=0)
    try:
        run.start_worker()
        short, long = run.app.tasks["bench.work"], run.app.tasks["bench.work_long"]
        for task in (short, long):  # the sub-queues exist and their run times are known before the clock starts
            task.apply_async(("warm", time.time(), 0.0), tier="realtime")
        time.sleep(2.5)
        t0 = time.time()
        streams = {
            "short": (40.0, lambda: short.apply_async(("short", time.time(), 0.02), tier="realtime")),
            "long": (4.8, lambda: long.apply_async(("long", time.time(), 0.5), tier="realtime")),
        }
        poisson_streams(streams, t0, t0 + duration, random.Random(5))
        time.sleep(3.0)
        records = [r for r in run.read() if r[0] in ("short", "long") and r[1] >= t0]
    finally:
        run.close()
    waits = {kind: [start - sent for k, sent, start, _ in records if k == kind] for kind in ("short", "long")}
    return {
        "short_mean_wait_s": sum(waits["short"]) / max(len(waits["short"]), 1),
        "short_p99_wait_s": percentile(waits["short"], 99),
        "long_p99_wait_s": percentile(waits["long"], 99),
        "long_max_wait_s": max(waits["long"], default=0.0),
        "done": {kind: len(v) for kind, v in waits.items()},
    }


def bench_sjf(broker: str, duration: float, logdir: Path, out=print) -> dict[str, Any]:
    kind = broker_kind(broker)
    fifo = run_sjf(broker, duration, logdir, sjf=False)
    sjf = run_sjf(broker, duration, logdir, sjf=True)
    ratio = sjf["short_mean_wait_s"] / max(fifo["short_mean_wait_s"], 1e-9)
    out(
        f"\n== {kind}: realtime at ~80 % load, 20 ms and 500 ms tasks, {duration:.0f} s, concurrency 4: short tasks' "
        f"mean wait {fifo['short_mean_wait_s'] * 1000:.0f} ms FIFO in the tier, "
        f"{sjf['short_mean_wait_s'] * 1000:.0f} ms shortest-first, ratio {ratio:.2f} (target <= 0.5); "
        f"long tasks' P99/max wait "
        f"{fifo['long_p99_wait_s']:.2f}/{fifo['long_max_wait_s']:.2f} s FIFO, {sjf['long_p99_wait_s']:.2f}/"
        f"{sjf['long_max_wait_s']:.2f} s shortest-first (bound: FIFO + prio_sjf_max_wait 1.0 s)"
    )
    return {"fifo_in_tier": fifo, "sjf": sjf, "short_wait_ratio": ratio}
