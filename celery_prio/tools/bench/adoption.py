"""An existing app adopts celery-prio: its own patterns, plain Celery vs ``install(app)`` (``--only adoption``).

The app is ``celery_prio.tools.adoptapp``: a default queue and routes of
its own. Each row starts a fresh (cold) worker with ``install()``'s
defaults, or none for plain Celery, and times one pattern from the first
publish to the last result:

* **own queue**: ``task_routes`` send the app's work to its own queue, the
  worker runs ``-c 2 -Q <that queue>``; 40 tasks of 100 ms;
* **waiting parent**: a task starts a group of 8 children (100 ms each) and
  waits on it (``.get(disable_sync_subtasks=False)``), worker ``-c 2``; three
  such parents one after the other.

A pattern that does not finish within ``HANG_AFTER`` seconds (or fails) is
reported as hung. Targets: nothing hangs; own queue within 1.1x of plain; waiting parent
within 1.5x.
"""

from __future__ import annotations

import gc
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from ..adoptapp import make_app, worker_env
from ..workers import WorkerProcess, free_port
from .core import RECORD_URL, broker_kind

HANG_AFTER = 60.0
OWN_QUEUE_TASKS, OWN_QUEUE_SECONDS = 40, 0.1
PARENTS, CHILDREN, CHILD_SECONDS = 3, 8, 0.1


def _timed(pattern: str, app: Celery) -> float | None:
    """Seconds from the first publish to the last result; None when it did not finish in ``HANG_AFTER``.

    Results are polled every 10 ms (``ready()``), the same for both setups, then collected (``get()``), so
    that no result subscription is left for the interpreter's exit to tear down."""
    started = time.monotonic()
    deadline = started + HANG_AFTER

    def finished(results: list) -> bool:
        while not all(r.ready() for r in results):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        for r in results:  # ready: this returns at once, and drops the backend's hold on the result
            r.get(timeout=5, propagate=False)
        return all(r.successful() for r in results)

    if pattern == "own_queue":
        work = app.tasks["adopt.own.a.work"]
        if not finished([work.delay(f"w{i}", OWN_QUEUE_SECONDS) for i in range(OWN_QUEUE_TASKS)]):
            return None
    else:
        fan_out = app.tasks["adopt.a.fan_out"]
        for _ in range(PARENTS):
            if not finished([fan_out.delay(CHILDREN, CHILD_SECONDS)]):
                return None
    return time.monotonic() - started


def run_pattern(pattern: str, setup: str, broker: str, logdir: Path) -> float | None:
    """One cold worker of the adopting app (``setup``: plain, or prio with install()'s defaults)."""
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    settings: dict[str, Any] = {}
    if setup == "prio, no management API":
        settings["management_url"] = f"http://guest:guest@127.0.0.1:{free_port()}"
    plain = setup == "plain"
    app = make_app(prefix, broker, RECORD_URL, settings, plain=plain)
    queues = [f"{prefix}-default"] if pattern == "own_queue" else None
    worker = WorkerProcess(
        "celery_prio.tools.adoptapp",
        log_path=logdir / f"adoption-{pattern}-{setup.split(',')[0]}-{prefix}.log",
        concurrency=2,
        queues=queues,
        env=worker_env(prefix, broker, RECORD_URL, settings, plain=plain),
    )
    try:
        worker.wait_ready()
        return _timed(pattern, app)
    finally:
        worker.kill()
        _clean(app, prefix, plain)
        gc.collect()  # results sit in reference cycles: collected now, not at interpreter exit (a traceback each)
        app.close()


def _clean(app: Celery, prefix: str, plain: bool) -> None:
    from ...brokers import adapter_for
    from ...settings import load_settings
    from ...tiers import TIERS

    names = [f"{prefix}-default", f"{prefix}-celery"]
    if not plain:
        settings = load_settings(app.conf)
        names += [settings.queue_name(t) for t in TIERS]
    adapter = adapter_for(app)
    try:
        adapter.delete_queues(names + (adapter.subqueues(load_settings(app.conf)) if not plain else []))
    except Exception:  # best effort: a benchmark's leftovers carry its own prefix
        pass
    finally:
        adapter.close()


def bench_adoption(broker: str, logdir: Path, out=print) -> dict[str, dict[str, float | None]]:
    kind = broker_kind(broker)
    setups = ["plain", "prio"] + (["prio, no management API"] if kind == "amqp" else [])
    figures: dict[str, dict[str, float | None]] = {}
    out(f"\n== {kind}: an app with its own queue and routes adopts celery-prio (install() defaults, cold, -c 2)")
    out(f"{'pattern':<52}{'setup':<26}{'seconds':>9}{'x plain':>9}")
    labels = {
        "own_queue": f"own queue only (-Q), {OWN_QUEUE_TASKS} x {OWN_QUEUE_SECONDS * 1000:.0f} ms",
        "waiting_parent": f"waiting parent: {PARENTS} x group of {CHILDREN} x {CHILD_SECONDS * 1000:.0f} ms",
    }
    for pattern, label in labels.items():
        row = figures[pattern] = {setup: run_pattern(pattern, setup, broker, logdir) for setup in setups}
        plain = row["plain"]
        for setup, seconds in row.items():
            shown = "HUNG" if seconds is None else f"{seconds:.2f}"
            ratio = "" if seconds is None or not plain or setup == "plain" else f"{seconds / plain:.2f}"
            out(f"{label:<52}{setup:<26}{shown:>9}{ratio:>9}")
    return figures
