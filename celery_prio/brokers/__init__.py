"""Brokers: the only code that knows a broker's own commands, behind the interfaces of ``base.py``.

Three factories choose the implementation from the app's broker:
``publisher_for(app)`` (the producer side, from the URL alone),
``adapter_for(app)`` (operators' :class:`~.base.Broker`, on a connection of
its own) and ``fetch_source_for(...)`` (a worker's
:class:`~.base.BrokerFetchSource`, on a consumer's channel). Each imports only the
package of the broker in use: a Redis app never loads the AMQP code.
"""

from __future__ import annotations

import logging

from celery import Celery
from kombu import Connection

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from .base import Broker, BrokerFetchSource, BrokerFigures, FetchSource, Job, Take
from .publishing import Publisher

SUPPORTED = "celery-prio supports the redis and amqp (RabbitMQ) transports"
logger = logging.getLogger(__name__)


def adapter_for(app: Celery) -> Broker:
    kind = app.connection_for_write().transport.driver_type
    if kind == "redis":
        from .redis.admin import RedisAdapter

        return RedisAdapter(app)
    if kind == "amqp":
        from .amqp.admin import AmqpAdapter

        return AmqpAdapter(app)
    raise ValueError(f"{SUPPORTED}, not {kind!r}")


def fetch_source_for(
    app: Celery, connection: Connection, served: ServedQueues, settings: PrioSettings, worker_name: str
) -> BrokerFetchSource:
    """A fetch source on a channel of its own: its round trips and the acks of what it took live there."""
    kind = connection.transport.driver_type
    if kind == "redis":
        from .redis.fetch import RedisFetchSource

        if settings.fetch == "consume":
            logger.warning("celery-prio: prio_fetch='consume' is for RabbitMQ; Redis is fetched as always")
        return RedisFetchSource(app, connection.channel(), served, settings, worker_name)
    if kind == "amqp":
        if settings.fetch == "consume":
            from .amqp.consume import AmqpConsumeSource

            return AmqpConsumeSource(app, connection.channel(), served, settings)
        from .amqp.fetch import AmqpFetchSource

        return AmqpFetchSource(app, connection.channel(), served, settings)
    raise ValueError(f"{SUPPORTED}, not {kind!r}")


def publisher_for(app: Celery) -> Publisher:
    """The broker's publish-side support, from the broker URL (no connection made)."""
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://"
    if isinstance(url, (list, tuple)):
        url = url[0]
    scheme = url.split("://", 1)[0]
    kinds = {
        "redis": "redis",
        "rediss": "redis",
        "sentinel": "redis",
        "amqp": "amqp",
        "amqps": "amqp",
        "pyamqp": "amqp",
    }
    kind = kinds.get(scheme) or Connection(url).transport.driver_type
    if kind == "redis":
        from .redis.publishing import RedisPublisher

        return RedisPublisher(app)
    if kind == "amqp":
        from .amqp.publishing import AmqpPublisher

        return AmqpPublisher(app)
    return Publisher(app)


__all__ = [
    "Broker",
    "BrokerFetchSource",
    "BrokerFigures",
    "FetchSource",
    "Job",
    "Publisher",
    "Take",
    "adapter_for",
    "fetch_source_for",
    "publisher_for",
]
