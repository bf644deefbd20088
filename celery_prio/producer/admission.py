"""Publish-side admission: a full tier refuses at once with ``QueueFull``.

Redis refuses inside the atomic publish script (``brokers/redis_transport``)
and raises ``QueueFull`` itself. RabbitMQ refuses with a publisher-confirm
nack, which kombu surfaces as ``OperationalError``; the broker's
``Publishing.refusal`` recognises it and this wrapper around
``app.send_task`` raises ``QueueFull`` for the tier the router chose.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from kombu.exceptions import OperationalError

from ..brokers.publishing import Publishing
from ..settings import PrioSettings

#: The tier the router picked for the publish in flight on this thread.
last_route = threading.local()


def guard_send_task(app: Any, settings: PrioSettings, publishing: Publishing) -> None:
    send_task = app.send_task
    if getattr(send_task, "celery_prio", False):
        send_task = send_task.__wrapped__

    @functools.wraps(send_task)
    def send_task_admitted(*args: Any, **kwargs: Any) -> Any:
        publishing.before_send(app, settings)
        last_route.tier = last_route.queue = None
        try:
            return send_task(*args, **kwargs)
        except OperationalError as exc:
            tier = getattr(last_route, "tier", None)
            full = None if tier is None else publishing.refusal(app, settings, tier, exc)
            if full is None:
                raise
            raise full from None

    send_task_admitted.celery_prio = True  # type: ignore[attr-defined]
    app.send_task = send_task_admitted
