"""How soon a SIGKILLed worker's ``acks_late`` tasks run again, and the chaos run (``--only recovery|chaos``)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...settings import load_settings
from .core import Run, broker_kind


def run_recovery(mode: str, broker: str, logdir: Path, limit: float, **app_options: Any) -> dict[str, float | None]:
    """Per tier, seconds from SIGKILL of a worker running an ``acks_late`` task to its start on the worker
    started in its place (None: not within ``limit``). Plain Celery has one queue: its three tasks stand
    for the tiers."""
    run = Run(mode, broker, logdir, 3, **app_options)
    try:
        run.start_worker()
        doomed = run.worker
        late = run.app.tasks["bench.work_late"]
        for tier in ("realtime", "batch", "offline"):
            late.apply_async((tier, 3600.0), **({"tier": tier} if mode == "prio" else {}))
        key = f"{run.prefix}:starts"

        def starts() -> list[tuple[str, float, str]]:
            rows = (row.decode().split() for row in run.records.lrange(key, 0, -1))
            return [(label, float(at), pid) for label, at, pid in rows]

        deadline = time.time() + 30
        while len(starts()) < 3 and time.time() < deadline:
            time.sleep(0.05)
        if len(starts()) < 3:
            raise RuntimeError(f"{mode}: the three tasks did not all start on the first worker")
        killed = time.time()
        doomed.kill()
        # Its replacement starts right away (a supervisor's restart): plain Celery's kombu restores
        # expired messages on its first look (ten seconds in), then every hundredth second only.
        run.start_worker()
        back: dict[str, float | None] = {tier: None for tier in ("realtime", "batch", "offline")}
        while time.time() < killed + limit and None in back.values():
            for label, at, _ in starts()[3:]:
                if back[label] is None:
                    back[label] = at - killed
            time.sleep(0.05)
        return back
    finally:
        run.close()
        run.records.delete(f"{run.prefix}:starts")


def bench_recovery(broker: str, logdir: Path, limit: float = 75.0, out=print) -> dict[str, Any]:
    """A worker SIGKILLed with acks_late tasks in flight: how soon they run again, plain Celery vs celery-prio."""
    kind = broker_kind(broker)
    setups = {"plain Celery": ("fifo", {})}
    if kind == "redis":  # RabbitMQ returns a dead connection's messages at once, either way
        # kombu restores a gone worker's messages once they are visibility_timeout old, in a sweep
        # every unacked_restore_interval x unacked_restore_throttle s (10 x 10): tuned down, as far as
        # plain Celery goes (and then any task running longer than 5 s is run twice on a live worker).
        setups["plain Celery, visibility_timeout 5 s"] = ("fifo", {"transport_options": {"visibility_timeout": 5}})
        fastest = {"visibility_timeout": 5, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        setups["plain Celery, visibility_timeout 5 s, sweep every 1 s"] = ("fifo", {"transport_options": fastest})
    bounds = "/".join(f"{v:g}" for v in load_settings({}).redeliver_after.values())
    prio_name = f"celery-prio (prio_redeliver_after {bounds} s)" if kind == "redis" else "celery-prio"
    setups[prio_name] = ("prio", {})
    results = {name: run_recovery(mode, broker, logdir, limit, **options) for name, (mode, options) in setups.items()}
    show = lambda v: f"{v:.1f} s" if v is not None else f"not within {limit:.0f} s"  # noqa: E731
    out(f"\n== {kind}: a worker SIGKILLed with an acks_late task per tier in flight, another started at once:")
    for name, back in results.items():
        out(f"  {name}: back after " + " / ".join(f"{tier} {show(v)}" for tier, v in back.items()))
    if kind == "redis":
        plain = results["plain Celery, visibility_timeout 5 s, sweep every 1 s"]["realtime"]
        prio = results[prio_name]["realtime"]
        if plain and prio:
            out(
                f"  realtime back: celery-prio / plain Celery tuned to 5 s = {prio / plain:.2f} (and plain Celery "
                "then runs any task longer than 5 s twice; celery-prio never re-runs a live worker's task)"
            )
    return results


def bench_chaos(logdir: Path, duration: float = 60.0, out=print) -> dict[str, Any]:
    """Workers SIGKILLed and restarted in place, and the broker restarted, under a mixed load, with the
    default bounds (``celery_prio.tools.chaos``; Redis: the run restarts a private redis-server)."""
    from ..chaos import run_chaos

    out(f"\n== redis: chaos for {duration:.0f} s (3 workers, default prio_redeliver_after):")
    defaults = {"redeliver_after": {t.label: v for t, v in load_settings({}).redeliver_after.items()}}
    result = run_chaos(logdir / "chaos", duration=duration, settings=defaults, out=out)
    out("  every accepted task completed, none ran twice unexplained, nothing left" if result.ok else "  FAILED")
    return {**asdict(result), "accepted": dict(result.accepted), "ok": result.ok}
