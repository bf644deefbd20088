"""Remote control: ``celery -A app inspect prio_stats`` (a worker's per-tier figures as JSON) and
``prio_supersede`` (boosts on RabbitMQ: which task copies are stale).

Imported by ``install()`` so that both the worker (which answers) and the
``celery inspect`` client (which checks command names) know the commands.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from celery.utils.log import get_logger
from celery.worker.control import control_command, inspect_command

from ..runtime import runtime_of
from ..signing import NO_KEY, app_boost_key, sign, verified
from .gpus import worker_gpus
from .held_requests import waiting_requests
from .unserved import EveryMinute

if TYPE_CHECKING:
    from celery import Celery

logger = get_logger(__name__)


@inspect_command()
def prio_stats(state: Any) -> dict[str, object]:
    """Per-tier dispatch, share, wait and run-time figures of this worker (celery-prio)."""
    fetcher = getattr(state.consumer, "task_consumer", None)
    info = getattr(fetcher, "info", None)
    if info is None:
        return {"error": "this worker does not run celery-prio's consumer"}
    return {**info(), "gpus": worker_gpus()}


def collect_prio_stats(
    app: Celery, timeout: float = 1.0, limit: int | None = None, destination: list[str] | None = None
) -> dict[str, object]:
    """``{worker: prio_stats}`` from every worker (or those named in ``destination``) answering within ``timeout``."""
    replies = (
        app.control.broadcast("prio_stats", reply=True, timeout=timeout, limit=limit, destination=destination) or []
    )
    merged: dict[str, object] = {}
    for reply in replies:
        merged.update(reply)
    return merged


@control_command(
    args=[("task_id", str), ("generation", int), ("retract", bool)],
    signature="<task_id> <generation> [retract]",
)
def prio_supersede(
    state: Any,
    task_id: str,
    generation: int,
    retract: bool = False,
    commit: bool = False,
    pending_for: float | None = None,
    sig: str | None = None,
) -> dict[str, object]:
    """celery-prio boost (RabbitMQ): copies of ``task_id`` below ``generation`` are stale; say if held here.

    Runs on the worker's event loop, like its fetches: either this worker
    holds the task now (it answers ``held``, records nothing), or any copy it
    fetches from now on is checked against the record: pending (for at most
    ``pending_for`` s) until the booster ``commit``s, once its copy is on the broker.
    Only a broadcast signed under the app's boost key is obeyed (``celery_prio/signing.py``); the answer is
    signed too, so that the booster counts only this app's workers.
    """
    runtime = runtime_of(state.app)
    superseded = getattr(getattr(state, "consumer", None), "superseded", None)  # PrioConsumer's records
    if runtime is None or superseded is None:
        return {"error": "this worker does not run celery-prio"}
    settings = runtime.settings
    prefix = settings.queue_prefix
    key = app_boost_key(state.app, settings)
    action = "retract" if retract else "commit" if commit else "pending"
    if not verified(key, sig, "supersede", task_id, generation, action):
        _refused_supersede(key is None)
        return {"prefix": prefix, "refused": NO_KEY if key is None else "not signed with this app's boost key"}
    if retract:
        superseded.retract(task_id, generation)
        return {"prefix": prefix, "retracted": True}
    if commit:
        superseded.commit(task_id, generation, time.time())
        return {"prefix": prefix, "committed": True}
    held = any(r.id == task_id for r in waiting_requests(getattr(getattr(state, "consumer", None), "timer", None)))
    if not held:
        pending = float(pending_for) if isinstance(pending_for, (int, float)) and pending_for > 0 else None
        superseded.record(task_id, generation, time.time(), pending_for=pending)
    assert key is not None  # verified above
    return {"prefix": prefix, "held": held, "sig": sign(key, "answer", task_id, generation, held)}


#: A forged or misconfigured broadcast is said at most once a minute.
_refusals_said = EveryMinute()


def _refused_supersede(no_key: bool) -> None:
    if _refusals_said.due(time.monotonic(), True):
        logger.warning(
            "celery-prio: ignored a prio_supersede broadcast: %s",
            NO_KEY
            if no_key
            else "not signed with this app's boost key (another app on the vhost, a forged "
            "message, or processes of one app with different prio_boost_key values)",
        )
