"""Broker adapters: the only code that knows a broker's own commands.

``adapter_for(app)`` returns the adapter for the app's broker transport.
"""

from __future__ import annotations

from typing import Any

from .amqp import AmqpAdapter
from .base import BrokerAdapter
from .redis import RedisAdapter


def adapter_for(app: Any) -> BrokerAdapter:
    conn = app.connection_for_write()
    kind = conn.transport.driver_type
    if kind == "redis":
        return RedisAdapter(app)
    if kind == "amqp":
        return AmqpAdapter(app)
    raise ValueError(f"celery-prio supports the redis and amqp (RabbitMQ) transports, not {kind!r}")


__all__ = ["AmqpAdapter", "BrokerAdapter", "RedisAdapter", "adapter_for"]
