"""Dynamic batching inside realtime (``--only batching``): the example CNN served to Poisson realtime traffic at
rising rates while a batch backlog runs, side by side: celery-prio unbatched, celery-prio batched
(``celery_prio.Batch(max_size=32, max_delay=0.005)``), and ``celery-batches`` on plain Celery (with what it
needs: unlimited prefetch, the backlog in a queue of its own).

For each setup and rate, a fresh worker of 2 slots (the model warmed up before the clock): realtime P50/P99
(publish to the call's end, recorded by the worker), whether every call was answered, and the batch tier's
throughput (images per second of ``bench.infer_chunk``); then the highest rate each setup sustains with every
call answered and P99 <= 200 ms.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...errors import QueueFull
from ..benchapp import has_celery_batches
from .core import Run, broker_kind, percentile, poisson_streams

#: Realtime rates tried, per second (Poisson).
RATES = (100, 200, 400, 800, 1600)
#: The realtime latency target a rate must keep (P99, seconds).
TARGET_P99 = 0.2
#: Images per batch-tier job (one forward pass each), and jobs queued per second of a run (more than it does).
CHUNK = 256
CHUNKS_PER_S = 100
SETUPS = {
    "celery-prio, unbatched": ("prio", "bench.classify"),
    "celery-prio, batched": ("prio", "bench.classify_batched"),
    "celery-batches, plain Celery": ("batches", "bench.classify_celery_batches"),
}


def _image(rng: random.Random) -> list[list[float]]:
    return [[float(rng.randint(0, 16)) for _ in range(8)] for _ in range(8)]


def run_rate(
    setup: str, broker: str, rate: int, seconds: float, logdir: Path, python: str | None = None
) -> dict[str, Any]:
    mode, task_name = SETUPS[setup]
    run = Run(mode, broker, logdir, concurrency=2)
    run.extra_env = {"BENCH_WARM_MODEL": "1"}  # every pool process loads the model before it is ready
    run.python = python
    rng = random.Random(rate)
    try:
        run.start_worker()
        # celery-batches' task is defined only where celery-batches is installed (the worker's): sent by name.
        task = run.app.tasks.get(task_name) or run.app.signature(task_name)
        chunk = run.app.tasks["bench.infer_chunk"]
        run.publish_task(task, ("warm", time.time(), _image(rng)), "realtime")  # the model loads before the clock
        deadline = time.time() + 30
        while not any(r[0] == "warm" for r in run.read()) and time.time() < deadline:
            time.sleep(0.05)
        for i in range(int(CHUNKS_PER_S * seconds)):  # the batch tier stays busy for the whole run
            run.publish_task(chunk, ("batch", time.time(), CHUNK, i), "batch")
        refused = 0

        def call() -> None:
            nonlocal refused
            try:
                run.publish_task(task, ("realtime", time.time(), _image(rng)), "realtime")
            except QueueFull:  # the realtime tier is full: a caller gets 429 (not answered in time)
                refused += 1

        t0 = time.time()
        sent = poisson_streams({"rt": (rate, call)}, t0, t0 + seconds, rng)["rt"] - refused
        deadline = time.time() + 5.0
        while sum(r[0] == "realtime" for r in run.read()) < sent and time.time() < deadline:
            time.sleep(0.05)
        cutoff, records = time.time(), run.read()
    finally:
        run.close()
    latencies = [end - sent_at for tier, sent_at, _, end in records if tier == "realtime"]
    latencies += [cutoff - t0] * max(0, sent - len(latencies))  # unanswered: as late as the cutoff
    chunks = sum(1 for tier, _, _, end in records if tier == "batch" and end <= t0 + seconds)
    return {
        "sent": sent,
        "refused": refused,
        "done": sum(1 for r in records if r[0] == "realtime"),
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "batch_images_per_s": CHUNK * chunks / seconds,
    }


def sustained(rows: dict[str, Any]) -> int:
    """The highest rate whose every call was answered with P99 within the target (0: none)."""
    kept = [
        rate
        for rate, row in rows.items()
        if not row["refused"] and row["done"] == row["sent"] and row["p99_ms"] <= 1000 * TARGET_P99
    ]
    return max(map(int, kept), default=0)


def baseline_python(batches_python: str | None) -> str | None:
    """The interpreter celery-batches' worker runs under, or None when there is none (its row is skipped).

    celery-batches caps Celery below 5.7, so it usually has a virtualenv of its own (``--batches-python``).
    """
    if batches_python is None:
        return sys.executable if has_celery_batches() else None
    try:
        probe = subprocess.run(
            [batches_python, "-c", "import celery_batches, celery_prio.tools.benchapp"], capture_output=True, text=True
        )
        problem = probe.stderr[-800:] if probe.returncode else None
    except OSError as exc:  # no such interpreter, or not executable
        problem = str(exc)
    if problem is not None:
        raise SystemExit(
            f"--batches-python {batches_python}: cannot import celery_batches and celery_prio there "
            f"(pip install torch==2.13.0 -e '.[demo,batches-baseline]' in that virtualenv):\n{problem}"
        )
    return batches_python


def bench_batching(
    broker: str,
    logdir: Path,
    rates: tuple[int, ...] = RATES,
    seconds: float = 8.0,
    batches_python: str | None = None,
) -> dict:
    kind = broker_kind(broker)
    baseline = baseline_python(batches_python)
    setups = [s for s in SETUPS if baseline or SETUPS[s][0] != "batches"]
    if not baseline:
        print(
            "note: celery-batches is not installed here, so its row is skipped; it caps Celery below 5.7: "
            "install it in a virtualenv of its own and pass --batches-python (docs/guides/batching.md)"
        )
    print(
        f"\n== {kind}: dynamic batching (the example CNN, one worker of 2 slots, batch backlog running, {seconds:g} s)"
    )
    print(f"{'setup':<32}{'rate/s':>8}{'done':>12}{'429s':>6}{'p50 ms':>9}{'p99 ms':>9}{'batch img/s':>13}")
    results: dict[str, Any] = {}
    for setup in setups:
        rows = results[setup] = {}
        python = baseline if SETUPS[setup][0] == "batches" else None
        for rate in rates:
            row = rows[str(rate)] = run_rate(setup, broker, rate, seconds, logdir, python)
            print(
                f"{setup:<32}{rate:>8}{row['done']:>6}/{row['sent']:<5}{row['refused']:>6}"
                f"{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}"
                f"{row['batch_images_per_s']:>13,.0f}"
            )
    best = {setup: sustained(rows) for setup, rows in results.items()}
    unbatched, batched = best["celery-prio, unbatched"], best["celery-prio, batched"]
    ratio = batched / unbatched if unbatched else (float("inf") if batched else 0.0)
    print("sustained at P99 <= 200 ms: " + ", ".join(f"{s} {r}/s" for s, r in best.items()))
    print(f"  batched / unbatched: {ratio:.1f}x (target >= 3x)")
    results["sustained"], results["ratio"] = best, ratio
    return results
