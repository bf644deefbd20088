"""Publish-side admission: a full tier refuses at once with ``QueueFull``.

Redis refuses inside the atomic publish script (``brokers/redis_transport``)
and raises ``QueueFull`` itself. RabbitMQ refuses with a publisher-confirm
nack, which kombu surfaces as ``OperationalError`` caused by
``MessageNacked``; this wrapper around ``app.send_task`` turns that into
``QueueFull`` for the tier the router chose.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from amqp.exceptions import MessageNacked
from kombu.exceptions import OperationalError

from .errors import QueueFull
from .settings import PrioSettings
from .tiers import Tier

#: The tier the router picked for the publish in flight on this thread.
last_route = threading.local()


def _nacked(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MessageNacked):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def guard_send_task(app: Any, settings: PrioSettings, broker_kind: str) -> None:
    send_task = app.send_task
    if getattr(send_task, "celery_prio", False):
        send_task = send_task.__wrapped__
    declared = threading.Event()

    @functools.wraps(send_task)
    def send_task_admitted(*args: Any, **kwargs: Any) -> Any:
        if broker_kind == "amqp" and not declared.is_set():
            _declare_amqp(app, settings)
            declared.set()
        last_route.tier = None
        try:
            return send_task(*args, **kwargs)
        except OperationalError as exc:
            tier = getattr(last_route, "tier", None)
            if tier is None or not _nacked(exc):
                raise
            raise _queue_full_amqp(app, settings, tier) from None

    send_task_admitted.celery_prio = True  # type: ignore[attr-defined]
    app.send_task = send_task_admitted


def _declare_amqp(app: Any, settings: PrioSettings) -> None:
    from .brokers.amqp import declare_tier_queues

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=3)
        declare_tier_queues(conn.channel(), settings)


def _queue_full_amqp(app: Any, settings: PrioSettings, tier: Tier) -> QueueFull:
    from .brokers.amqp import refusal_figures

    depth, rate = refusal_figures(app, settings, tier)
    return QueueFull.from_drain_rate(tier, depth, rate)
