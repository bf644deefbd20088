"""Fleet scale: what idle workers cost the broker, how fast an idle fleet picks up a lone task, and broker CPU
per task of a busy fleet, plain Celery against celery-prio side by side (``--only scale``).

Idle: N workers of the same app (``--concurrency 1``, defaults) sit with nothing to do for a window;
measured are the broker's CPU (Redis: its own counters; RabbitMQ: the ``beam.smp`` process), Redis
commands per second (server-wide), and the workers' own CPU (every process of their process groups).
Then lone realtime tasks, one at a time, give the pickup latency (publish to start). Busy: 16 workers
drain a mixed backlog; the broker's CPU per task done.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from ...brokers.redis.housekeeping import SLOTS_SETTLE
from .core import DEFAULTS_RT_RATE, Run, Workload, broker_kind, percentile, run_mixed

#: Seconds the fleet settles after its last worker is ready, before the idle window starts.
SETTLE = 3.0
#: Seconds after the fleet is ready before an idle window starts: a Redis housekeeper paces itself faster for
#: ``SLOTS_SETTLE`` after the fleet's slots change (a cold fleet is one), so the window shows the steady state.
IDLE_STEADY_AFTER = SLOTS_SETTLE + 1.0
#: Lone realtime tasks published one at a time, and the pause between them (each finds the fleet idle).
PICKUPS = 20
PICKUP_GAP = 0.3
_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields after the command name (which may hold spaces)


def _cpu_ticks(fields: list[str]) -> int:
    return int(fields[11]) + int(fields[12])  # utime, stime


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the process ``pid`` alone (0 once it is gone)."""
    fields = _stat(str(pid))
    return _cpu_ticks(fields) / _TICK if fields else 0.0


def group_cpu(groups: set[int]) -> float:
    """CPU seconds (user + system) of every live process in the process groups ``groups``."""
    total = 0
    for pid in os.listdir("/proc"):
        fields = _stat(pid) if pid.isdigit() else None
        if fields and int(fields[2]) in groups:  # fields[2]: the process group
            total += _cpu_ticks(fields)
    return total / _TICK


def rabbitmq_cpu() -> float | None:
    """CPU seconds of the RabbitMQ node on this machine (its ``beam.smp``), None if there is none."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("beam"):
            fields = _stat(pid)
            return (int(fields[11]) + int(fields[12])) / _TICK if fields else None
    return None


class BrokerMeter:
    """The broker's CPU seconds and (Redis) commands processed, read before and after a window."""

    def __init__(self, broker: str) -> None:
        self.kind = broker_kind(broker)
        self.client = redis.Redis.from_url(broker) if self.kind == "redis" else None

    def read(self) -> tuple[float | None, int | None]:
        if self.client is None:
            return rabbitmq_cpu(), None
        cpu, stats = self.client.info("cpu"), self.client.info("stats")
        return cpu["used_cpu_sys"] + cpu["used_cpu_user"], int(stats["total_commands_processed"])


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    return None if before is None or after is None else (after - before) / seconds


def _fleet(mode: str, broker: str, workers: int, logdir: Path) -> Run:
    """``workers`` workers of one app (``--concurrency 1``), started together, ready and settled."""
    run = Run(mode, broker, logdir, concurrency=1)
    try:
        for _ in range(workers):
            run.start_worker(wait=False)
        for worker in run.workers:
            worker.wait_ready(timeout=60 + 3 * workers)
    except BaseException:
        run.close()
        raise
    time.sleep(SETTLE)
    return run


def run_idle(mode: str, broker: str, workers: int, window: float, logdir: Path) -> dict[str, Any]:
    """``workers`` idle workers for ``window`` seconds: broker CPU, Redis commands/s, workers' CPU; then pickups."""
    run, meter = _fleet(mode, broker, workers, logdir), BrokerMeter(broker)
    try:
        time.sleep(max(IDLE_STEADY_AFTER - SETTLE, 0.0))  # (both setups alike: plain Celery has no housekeeper)
        groups = {w.pid for w in run.workers}
        cpu0, (broker0, commands0), t0 = group_cpu(groups), meter.read(), time.monotonic()
        time.sleep(window)
        cpu1, (broker1, commands1), t1 = group_cpu(groups), meter.read(), time.monotonic()
        seconds = t1 - t0
        out: dict[str, Any] = {
            "workers": workers,
            "broker_cpu_pct": None if broker0 is None else 100 * _rate(broker0, broker1, seconds),
            "redis_commands_per_s": _rate(commands0, commands1, seconds),
            "workers_cpu_pct": 100 * (cpu1 - cpu0) / seconds,
        }
        out["worker_cpu_pct_each"] = out["workers_cpu_pct"] / workers
        out.update(pickup(run))
        return out
    finally:
        run.close()


def pickup(run: Run) -> dict[str, Any]:
    """Lone realtime tasks into the idle fleet, one at a time: publish to start, P50 and P99 (ms)."""
    waits = []
    for i in range(PICKUPS + 1):
        label = f"lone{i}"
        sent = run.publish("realtime", 0.0, label=label)
        deadline = time.time() + 10
        start = None
        while start is None and time.time() < deadline:
            start = next((r[2] for r in run.read() if r[0] == label), None)
            time.sleep(0.005)
        if i and start is not None:  # the first one warms the pool child up: not counted
            waits.append(1000 * (start - sent))
        time.sleep(PICKUP_GAP)
    if not waits:
        return {"pickup_p50_ms": None, "pickup_p99_ms": None, "picked_up": 0}
    return {"pickup_p50_ms": percentile(waits, 50), "pickup_p99_ms": percentile(waits, 99), "picked_up": len(waits)}


def _fill_subqueues(run: Run, count: int) -> None:
    """``count`` batch tenants, each with one task run through it: the fleet serves them all (most stay empty)."""
    if not count:
        return
    task = run.task
    for i in range(count):
        task.apply_async((f"sub{i}", time.time(), 0.0), tier="batch", subqueue=f"tenant{i}")
    deadline = time.monotonic() + 60
    while sum(1 for r in run.read() if r[0].startswith("sub")) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2 * SETTLE)  # every worker has found every tenant (the registry, a discovery round)


def run_busy(
    mode: str, broker: str, workers: int, tasks: int, logdir: Path, subqueues: int = 0, **options: Any
) -> dict[str, Any]:
    """``workers`` workers drain a backlog of ``tasks`` 2 ms tasks (batch and offline) published while they are
    stopped (SIGSTOP), plus a realtime trickle (20/s) during the drain: broker CPU and Redis commands per task
    (the drain's: fetch and ack; the publish's apart), drain time, the trickle's pickup P99."""
    run = Run(mode, broker, logdir, concurrency=1, **options)
    try:
        for _ in range(workers):
            run.start_worker(wait=False)
        for worker in run.workers:
            worker.wait_ready(timeout=60 + 3 * workers)
        time.sleep(SETTLE)
        _fill_subqueues(run, subqueues if mode == "prio" else 0)
        meter, groups = BrokerMeter(broker), {w.pid for w in run.workers}
        for pid in groups:
            os.killpg(pid, signal.SIGSTOP)
        try:
            (cpu0, _), t0 = meter.read(), time.monotonic()
            for i in range(tasks):
                run.publish(("batch", "batch", "batch", "offline")[i % 4], 0.002)
            (cpu1, _), publish_s = meter.read(), time.monotonic() - t0
        finally:
            for pid in groups:
                os.killpg(pid, signal.SIGCONT)
        (broker0, commands0), t1 = meter.read(), time.monotonic()
        trickle, next_at = [], t1

        def drained() -> bool:  # a length first: reading every record each 5 ms would load a Redis broker itself
            if run.records.llen(f"{run.prefix}:records") < tasks:
                return False
            return sum(1 for r in run.read() if r[0] in ("batch", "offline")) >= tasks

        while not drained() and time.monotonic() < t1 + 120:
            if time.monotonic() >= next_at:
                trickle.append(run.publish("realtime", 0.0, label=f"rt{len(trickle)}"))
                next_at += 0.05
            time.sleep(0.005)
        (broker1, commands1), t2 = meter.read(), time.monotonic()
        done = sum(1 for r in run.read() if r[0] in ("batch", "offline"))
        time.sleep(0.5)  # the trickle's last calls
        starts = {r[0]: r[2] - r[1] for r in run.read() if r[0].startswith("rt")}
        waits = [1000 * w for w in starts.values()]
        return {
            "workers": workers,
            "subqueues": subqueues,
            "done": done,
            "seconds": t2 - t1,
            "publish_cpu_ms_per_task": None if cpu0 is None else 1000 * (cpu1 - cpu0) / tasks,
            "publish_s": publish_s,
            "broker_cpu_ms_per_task": None if broker0 is None or not done else 1000 * (broker1 - broker0) / done,
            "redis_commands_per_task": None if commands0 is None or not done else (commands1 - commands0) / done,
            "trickle_p99_ms": percentile(waits, 99) if waits else None,
            "trickle": f"{len(waits)}/{len(trickle)}",
        }
    finally:
        run.close()


def bench_busy(
    broker: str,
    logdir: Path,
    sizes: tuple[int, ...] = (4, 16, 64),
    subqueues: tuple[int, ...] = (0, 50, 500),
    tasks: int = 2000,
) -> dict[str, Any]:
    """The busy sweep: plain Celery and celery-prio side by side at each fleet size, then celery-prio at 16 workers
    serving more and more (mostly empty) tenant sub-queues; ratios against plain at the same size."""
    kind = broker_kind(broker)
    print(f"\n== {kind}: busy fleet ({tasks} tasks of 2 ms, batch and offline; realtime trickle 20/s; defaults)")
    print(
        f"{'setup':<16}{'workers':>8}{'subq':>6}{'broker ms/task':>16}{'cmd/task':>10}{'drain s':>9}"
        f"{'publish ms/task':>17}{'rt p99 ms':>11}{'cpu x':>7}{'drain x':>9}"
    )
    rows: dict[str, Any] = {}
    plain_at: dict[int, dict[str, Any]] = {}
    runs = [(mode, n, 0) for n in sizes for mode in ("fifo", "prio")]
    runs += [("prio", 16, k) for k in subqueues if k]
    for mode, n, k in runs:
        row = run_busy(mode, broker, n, tasks, logdir, k)
        if mode == "fifo":
            plain_at[n] = row
        plain = plain_at.get(n) or plain_at.get(16)
        if mode == "prio" and plain and plain["broker_cpu_ms_per_task"] and row["broker_cpu_ms_per_task"]:
            row["cpu_ratio"] = row["broker_cpu_ms_per_task"] / plain["broker_cpu_ms_per_task"]
            row["drain_ratio"] = row["seconds"] / plain["seconds"]
        rows[f"{mode}/{n}/{k}"] = row
        name = "plain Celery" if mode == "fifo" else "celery-prio"
        print(
            f"{name:<16}{n:>8}{k:>6}{_fmt(row['broker_cpu_ms_per_task'], 3):>16}"
            f"{_fmt(row['redis_commands_per_task']):>10}{row['seconds']:>9.2f}"
            f"{_fmt(row['publish_cpu_ms_per_task'], 3):>17}{_fmt(row['trickle_p99_ms']):>11}"
            f"{_fmt(row.get('cpu_ratio'), 2):>7}{_fmt(row.get('drain_ratio'), 2):>9}",
            flush=True,
        )
    return rows


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def bench_scale(
    broker: str,
    logdir: Path,
    sizes: tuple[int, ...] = (1, 16),
    window: float = 15.0,
    busy_tasks: int = 2000,
    busy_sizes: tuple[int, ...] = (4, 16, 64),
    busy_subqueues: tuple[int, ...] = (0, 50, 500),
) -> dict[str, Any]:
    """Idle fleets of each size and the busy sweep, plain Celery and celery-prio side by side."""
    kind = broker_kind(broker)
    print(f"\n== {kind}: fleet scale (idle workers, --concurrency 1, defaults; {window:g} s window)")
    print(
        f"{'setup':<22}{'workers':>8}{'broker cpu %':>14}{'redis cmd/s':>13}{'workers cpu %':>15}"
        f"{'each %':>8}{'pickup p50':>12}{'p99 ms':>8}"
    )
    results: dict[str, Any] = {"idle": {}, "busy": {}}
    for n in sizes:
        for mode in ("fifo", "prio"):
            row = run_idle(mode, broker, n, window, logdir)
            results["idle"][f"{mode}/{n}"] = row
            name = "plain Celery" if mode == "fifo" else "celery-prio"
            print(
                f"{name:<22}{n:>8}{_fmt(row['broker_cpu_pct']):>14}{_fmt(row['redis_commands_per_s'], 0):>13}"
                f"{_fmt(row['workers_cpu_pct']):>15}{_fmt(row['worker_cpu_pct_each'], 2):>8}"
                f"{_fmt(row['pickup_p50_ms']):>12}{_fmt(row['pickup_p99_ms']):>8}"
            )
        plain, ours = results["idle"][f"fifo/{n}"], results["idle"][f"prio/{n}"]
        checks = _idle_targets(plain, ours, n, kind)
        results["idle"][f"targets/{n}"] = checks
        print("  targets: " + "; ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in checks.items()))
    results["busy"] = bench_busy(broker, logdir, busy_sizes, busy_subqueues, busy_tasks)
    return results


def bench_latency(broker: str, logdir: Path, duration: float = 20.0) -> dict[str, Any]:
    """Realtime alone (40/s x 20 ms on one worker of 4 slots, nothing else queued), plain Celery and
    celery-prio, and celery-prio's realtime under the overload mix, side by side, cold, defaults."""
    alone = Workload(duration=duration, rt_rate=DEFAULTS_RT_RATE, offline_backlog=0, batch_load=0)
    overload = replace(Workload(duration=duration), rt_rate=DEFAULTS_RT_RATE)
    rows = {
        "plain Celery, realtime alone": run_mixed("fifo", broker, alone, logdir, cold=True)["realtime"],
        "celery-prio, realtime alone": run_mixed("prio", broker, alone, logdir, cold=True)["realtime"],
        "celery-prio, overload mix": run_mixed("prio", broker, overload, logdir, cold=True)["realtime"],
        # The option that trades batch throughput for realtime bursts (docs/operations/scale.md).
        "  same, prio_reserve=2": run_mixed("prio", broker, overload, logdir, cold=True, reserve=2)["realtime"],
    }
    print(f"realtime latency ({DEFAULTS_RT_RATE:g}/s x 20 ms, one worker of 4 slots, {duration:g} s, cold, defaults)")
    for name, row in rows.items():
        print(f"  {name:<32} P50 {row['p50_ms']:7.1f} ms  P99 {row['p99_ms']:7.1f} ms  ({row['done']}/{row['sent']})")
    plain = rows["plain Celery, realtime alone"]["p99_ms"]
    alone_ratio = rows["celery-prio, realtime alone"]["p99_ms"] / plain
    mix_ratio = rows["celery-prio, overload mix"]["p99_ms"] / plain
    print(
        f"  realtime alone P99 {alone_ratio:.2f}x plain (target <= 1.2x); overload mix P99 {mix_ratio:.2f}x plain's "
        f"realtime alone (target <= 2x)"
    )
    reserve2_ratio = rows["  same, prio_reserve=2"]["p99_ms"] / plain
    print(f"  with prio_reserve=2 (not the default): overload mix P99 {reserve2_ratio:.2f}x")
    return {"rows": rows, "alone_ratio": alone_ratio, "overload_ratio": mix_ratio, "reserve2_ratio": reserve2_ratio}


def _idle_targets(plain: dict, ours: dict, workers: int, kind: str) -> dict[str, bool]:
    """Issue 28's targets for an idle fleet, side by side with plain Celery in the same run."""
    out = {}
    if plain["broker_cpu_pct"] is not None and ours["broker_cpu_pct"] is not None:
        out["broker CPU <= 1.5x plain + 1 point"] = ours["broker_cpu_pct"] <= 1.5 * plain["broker_cpu_pct"] + 1
    if kind == "redis" and plain["redis_commands_per_s"] is not None:
        out["Redis cmd/s <= plain + 10/worker"] = (
            ours["redis_commands_per_s"] <= plain["redis_commands_per_s"] + 10 * workers
        )
    out["worker CPU <= 0.5 % each"] = ours["worker_cpu_pct_each"] <= 0.5
    if plain["pickup_p50_ms"] is not None and ours["pickup_p50_ms"] is not None:
        out["pickup P50 <= plain + 3 ms"] = ours["pickup_p50_ms"] <= plain["pickup_p50_ms"] + 3
    return out
