"""GPU time slices against broker-native priority and a reserved slot (``--only slices``)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .core import Run, await_realtime, broker_kind, percentile, poisson_streams


@dataclass
class SliceWorkload:
    """Issue 12's mix: long batch jobs of short slices, an offline backlog, a light realtime stream."""

    duration: float = 20.0
    concurrency: int = 1
    rt_rate: float = 5.0
    rt_seconds: float = 0.02
    batch_seconds: float = 2.0
    offline_seconds: float = 4.0
    element_seconds: float = 0.1
    offline_backlog: int = 5
    grace: float = 5.0
    seed: int = 11

    @property
    def batch_backlog(self) -> int:
        return math.ceil(1.5 * self.concurrency * self.duration / self.batch_seconds)


def run_sliced(
    mode: str,
    broker: str,
    w: SliceWorkload,
    logdir: Path,
    cold: bool = False,
    tier_on: str = "call",
    **app_options: Any,
) -> dict[str, Any]:
    """Realtime latency and batch/offline items per second on a worker busy with long sliced tasks."""
    run = Run(mode, broker, logdir, w.concurrency, tier_on=tier_on, **app_options)
    try:
        run.start(cold)
        for _ in range(w.offline_backlog):
            run.publish("offline", w.offline_seconds, elements=round(w.offline_seconds / w.element_seconds))
        for _ in range(w.batch_backlog):
            run.publish("batch", w.batch_seconds, elements=round(w.batch_seconds / w.element_seconds))
        t0 = time.time()
        t_end = t0 + w.duration
        streams = {"realtime": (w.rt_rate, lambda: run.publish("realtime", w.rt_seconds))}
        sent_rt = poisson_streams(streams, t0, t_end, random.Random(w.seed))["realtime"] - run.refused
        cutoff, records = await_realtime(run, sent_rt, w.grace)
    finally:
        run.close()
    rt = [end - sent for tier, sent, _, end in records if tier == "realtime"]
    rt += [cutoff - t0] * max(0, sent_rt - len(rt))
    items = {
        tier: sum(1 for r in records if r[0] == f"{tier}-item" and t0 <= r[3] <= t_end) for tier in ("batch", "offline")
    }
    return {
        "realtime": {
            "sent": sent_rt,
            "refused": run.refused,
            "p50_ms": percentile(rt, 50) * 1000,
            "p99_ms": percentile(rt, 99) * 1000,
        },
        "batch_items_per_s": items["batch"] / w.duration,
        "offline_items_per_s": items["offline"] / w.duration,
    }


def bench_slices(broker: str, w: SliceWorkload, logdir: Path, out=print) -> dict[str, Any]:
    kind = broker_kind(broker)
    sliced = {"slice": {"batch": w.element_seconds, "offline": w.element_seconds}}
    unsliced = {"slice": {"batch": None, "offline": None}}
    one = {
        "native": run_sliced("native", broker, w, logdir),
        "prio_sliced": run_sliced("prio", broker, w, logdir, reserve=0, **sliced),
        "prio_unsliced": run_sliced("prio", broker, w, logdir, reserve=0, **unsliced),
        # The idle-share rule decides how batch and offline split what realtime leaves (2:1 by default).
        "prio_sliced_next_below": run_sliced("prio", broker, w, logdir, reserve=0, idle_share="next_below", **sliced),
    }
    w4 = replace(w, concurrency=4)
    four = {
        "prio_reserve1_unsliced": run_sliced("prio", broker, w4, logdir, reserve=1, **unsliced),
        "prio_reserve0_sliced": run_sliced("prio", broker, w4, logdir, reserve=0, **sliced),
    }
    out(
        f"\n== {kind}: GPU time slices, {w.duration:.0f} s: batch {w.batch_seconds:.0f} s tasks and an offline "
        f"backlog of {w.offline_seconds:.0f} s tasks, both in {w.element_seconds * 1000:.0f} ms slices; "
        f"realtime {w.rt_rate:.0f}/s x {w.rt_seconds * 1000:.0f} ms"
    )
    out(f"{'setup':<42}{'rt p50 ms':>11}{'rt p99 ms':>11}{'batch items/s':>15}{'offline items/s':>17}")
    for label, rows in (("concurrency 1", one), ("concurrency 4", four)):
        for name, m in rows.items():
            out(
                f"{label + ', ' + name:<42}{m['realtime']['p50_ms']:>11.0f}{m['realtime']['p99_ms']:>11.0f}"
                f"{m['batch_items_per_s']:>15.1f}{m['offline_items_per_s']:>17.1f}"
            )
    native, prio = one["native"], one["prio_sliced"]
    ratios = {
        "c1_batch_items_prio_over_native": prio["batch_items_per_s"] / max(native["batch_items_per_s"], 1e-9),
        "c1_batch_items_next_below_over_native": one["prio_sliced_next_below"]["batch_items_per_s"]
        / max(native["batch_items_per_s"], 1e-9),
        "c1_rt_p99_ms": prio["realtime"]["p99_ms"],
        "c1_rt_p99_native_ms": native["realtime"]["p99_ms"],
        "c4_rt_p99_sliced_over_reserve": four["prio_reserve0_sliced"]["realtime"]["p99_ms"]
        / four["prio_reserve1_unsliced"]["realtime"]["p99_ms"],
        "c4_low_items_sliced_over_reserve": (
            four["prio_reserve0_sliced"]["batch_items_per_s"] + four["prio_reserve0_sliced"]["offline_items_per_s"]
        )
        / max(
            four["prio_reserve1_unsliced"]["batch_items_per_s"] + four["prio_reserve1_unsliced"]["offline_items_per_s"],
            1e-9,
        ),
    }
    out(
        f"concurrency 1: realtime P99 {prio['realtime']['p99_ms']:.0f} ms sliced (target <= 200) vs native priority "
        f"{native['realtime']['p99_ms']:.0f} ms; batch items/s prio/native = "
        f"{ratios['c1_batch_items_prio_over_native']:.2f} (target >= 0.85; with idle_share='next_below' "
        f"{ratios['c1_batch_items_next_below_over_native']:.2f})"
    )
    out(
        f"concurrency 4: reserve 0 + slices vs reserve 1 unsliced: realtime P99 ratio "
        f"{ratios['c4_rt_p99_sliced_over_reserve']:.2f} (target <= 1), batch+offline items/s ratio "
        f"{ratios['c4_low_items_sliced_over_reserve']:.2f} (target > 1)"
    )
    return {"concurrency_1": one, "concurrency_4": four, "ratios": ratios}
