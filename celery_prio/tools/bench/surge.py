"""Realtime under its own surge (issue 36): a Poisson stream of realtime calls above what the slots serve, next
to a batch backlog, with defaults and no warm-up; broker-native priority vs celery-prio side by side.

Per setup: calls offered, accepted, refused (429) and how fast a refusal returns, accepted P50/P99 (publish to
done), goodput (answered within the 200 ms target) against what the slots can serve in the window, accepted
calls not answered (expired past their deadline, or still waiting at the cut-off), and batch throughput. The same
calls to a batched realtime task (``celery_prio.Batch``) make one more celery-prio row per surge.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from ...errors import QueueFull
from ...settings import load_settings
from ..workers import free_port
from .core import Run, broker_kind, percentile

TARGET_S = 0.2


def run_surge(
    mode: str,
    broker: str,
    logdir: Path,
    factor: float,
    duration: float,
    concurrency: int = 4,
    rt_seconds: float = 0.02,
    batch_backlog: int = 300,
    batch_seconds: float = 0.1,
    grace: float = 3.0,
    batched: bool = False,
    **app_options: Any,
) -> dict[str, Any]:
    """One setup's surge. ``batched``: the realtime calls go to ``bench.work_batched`` (``celery_prio.Batch``),
    whose calls admission counts at their share of a batch run."""
    run = Run(mode, broker, logdir, concurrency, **app_options)
    run.raise_refusals = True  # counted here, with how fast each came back
    try:
        run.start(cold=True)
        for _ in range(batch_backlog):
            run.publish("batch", batch_seconds)
        rate = factor * concurrency / rt_seconds
        rng = random.Random(7)
        t0 = time.time()
        t_end, due = t0 + duration, t0
        offered, refused, refusal_s = 0, 0, []
        while due < t_end:
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.time()))
            offered += 1
            started = time.perf_counter()
            try:
                if batched:
                    run.publish_task(
                        run.app.tasks["bench.work_batched"], ("realtime", time.time(), rt_seconds), "realtime"
                    )
                else:
                    run.publish("realtime", rt_seconds)
            except QueueFull:
                refused += 1
                refusal_s.append(time.perf_counter() - started)
        accepted = offered - refused
        window = time.time() - t0  # the stream ran this long (a slow publisher runs past its plan)
        deadline = time.time() + grace
        while time.time() < deadline and sum(r[0] == "realtime" for r in run.read()) < accepted:
            time.sleep(0.1)
        records = run.read()
    finally:
        run.close()
    rt = [r for r in records if r[0] == "realtime"]
    latencies = [end - sent for _, sent, _, end in rt]
    batch_done = sum(1 for r in records if r[0] == "batch" and t0 <= r[3] <= t0 + window)
    capacity = concurrency * window / rt_seconds  # realtime calls the slots could run in the window, at most
    # What realtime may take while batch keeps its weight (8:2 by default, prio_weights): the seed's share.
    weights = {t.label: w for t, w in load_settings({}).weights.items()}
    share = capacity * weights["realtime"] / (weights["realtime"] + weights["batch"])
    good = sum(1 for x in latencies if x <= TARGET_S)
    return {
        "offered": offered,
        "offered_rate": round(offered / window, 1),
        "window_s": round(window, 2),
        "accepted": accepted,
        "refused": refused,
        "refusal_p99_ms": round(percentile(refusal_s, 99) * 1000, 2) if refusal_s else None,
        "answered": len(rt),
        "unanswered": accepted - len(rt),
        "accepted_p50_ms": round(percentile(latencies, 50) * 1000, 1),
        "accepted_p99_ms": round(percentile(latencies, 99) * 1000, 1),
        "goodput": good,
        "goodput_of_capacity": round(good / capacity, 3),
        "goodput_of_share": round(good / share, 3),
        "batch_per_s": round(batch_done / window, 1),
    }


def bench_surge(broker: str, logdir: Path, duration: float = 8.0, out=print) -> dict[str, Any]:
    """Realtime at 1.5x and 3x what the slots serve, a batch backlog running: native priority vs celery-prio."""
    kind = broker_kind(broker)
    setups: dict[str, tuple[str, dict[str, Any]]] = {"native": ("native", {}), "prio": ("prio", {})}
    if kind == "amqp":  # RabbitMQ as the stock image runs it: no management plugin (a closed port here)
        setups["prio (no management API)"] = ("prio", {"management_url": f"http://127.0.0.1:{free_port()}"})
    no_management = setups.get("prio (no management API)", ("prio", {}))[1]
    results: dict[str, Any] = {}
    for factor in (1.5, 3.0):
        rows = {name: run_surge(mode, broker, logdir, factor, duration, **o) for name, (mode, o) in setups.items()}
        # The same calls to a batched task (``celery_prio.Batch``, 32 at most): counted at their share of a run.
        rows["prio, batched task"] = run_surge("prio", broker, logdir, factor, duration, batched=True, **no_management)
        results[f"{factor}x"] = rows
        out(f"surge {factor}x of the slots ({kind}, {duration:.0f} s, defaults, cold, tier per call):")
        for name, row in rows.items():
            refusal = "-" if row["refusal_p99_ms"] is None else f"{row['refusal_p99_ms']:.1f} ms"
            out(
                f"  {name:<26} offered {row['offered']} ({row['offered_rate']}/s), accepted {row['accepted']}, "
                f"refused {row['refused']} (P99 {refusal}), accepted P50/P99 {row['accepted_p50_ms']:.0f}/"
                f"{row['accepted_p99_ms']:.0f} ms, within 200 ms {row['goodput']} "
                f"({row['goodput_of_capacity'] * 100:.0f} % of what the slots serve, "
                f"{row['goodput_of_share'] * 100:.0f} % of realtime's share beside batch), unanswered "
                f"{row['unanswered']}, batch {row['batch_per_s']}/s"
            )
        native, prio = rows["native"], rows["prio"]
        if native["accepted_p99_ms"] and prio["accepted_p99_ms"]:
            out(
                f"  ratio prio/native: accepted P99 {prio['accepted_p99_ms'] / native['accepted_p99_ms']:.2f}, "
                f"goodput {prio['goodput'] / max(native['goodput'], 1):.1f}x, batch "
                f"{prio['batch_per_s'] / max(native['batch_per_s'], 0.1):.2f}"
            )
    return results
