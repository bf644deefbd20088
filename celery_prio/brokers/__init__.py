"""Broker adapters: the only code that knows a broker's own commands.

``adapter_for(app)`` returns the :class:`~.base.Broker` for the app's broker
(its own connection); ``fetch_source_for(...)`` the worker's
:class:`~.base.FetchSource` on a consumer's channel.
"""

from __future__ import annotations

import logging
from typing import Any

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from .amqp import AmqpAdapter, AmqpFetchSource
from .base import Broker, BrokerFigures, FetchSource, Job, Take
from .redis import RedisAdapter, RedisFetchSource

SUPPORTED = "celery-prio supports the redis and amqp (RabbitMQ) transports"
logger = logging.getLogger(__name__)


def adapter_for(app: Any) -> Broker:
    conn = app.connection_for_write()
    kind = conn.transport.driver_type
    if kind == "redis":
        return RedisAdapter(app)
    if kind == "amqp":
        return AmqpAdapter(app)
    raise ValueError(f"{SUPPORTED}, not {kind!r}")


def fetch_source_for(
    app: Any, connection: Any, served: ServedQueues, settings: PrioSettings, worker_name: str
) -> FetchSource:
    """A fetch source on a channel of its own: its round trips and the acks of what it took live there."""
    kind = connection.transport.driver_type
    if kind == "redis":
        if settings.fetch == "consume":
            logger.warning("celery-prio: prio_fetch='consume' is for RabbitMQ; Redis is fetched as always")
        return RedisFetchSource(app, connection.channel(), served, settings, worker_name)
    if kind == "amqp":
        if settings.fetch == "consume":
            from .amqp_consume import AmqpConsumeSource

            return AmqpConsumeSource(app, connection.channel(), served, settings)
        return AmqpFetchSource(app, connection.channel(), served, settings)
    raise ValueError(f"{SUPPORTED}, not {kind!r}")


__all__ = [
    "AmqpAdapter",
    "Broker",
    "BrokerFigures",
    "FetchSource",
    "Job",
    "RedisAdapter",
    "Take",
    "adapter_for",
    "fetch_source_for",
]
