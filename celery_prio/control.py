"""``celery -A app inspect prio_stats``: a worker's per-tier figures as JSON.

Imported by ``install()`` so that both the worker (which answers) and the
``celery inspect`` client (which checks command names) know the command.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command


@inspect_command()
def prio_stats(state: Any) -> dict[str, Any]:
    """Per-tier dispatch, share, wait and run-time figures of this worker (celery-prio)."""
    fetcher = getattr(state.consumer, "task_consumer", None)
    info = getattr(fetcher, "info", None)
    if info is None:
        return {"error": "this worker does not run celery-prio's consumer"}
    return info()


def collect_prio_stats(app: Any, timeout: float = 1.0, limit: int | None = None) -> dict[str, Any]:
    """``{worker: prio_stats}`` from every worker that answers within ``timeout``."""
    replies = app.control.broadcast("prio_stats", reply=True, timeout=timeout, limit=limit) or []
    merged: dict[str, Any] = {}
    for reply in replies:
        merged.update(reply)
    return merged
