"""Continuations of sliced tasks on RabbitMQ."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ...settings import PrioSettings
from ...tiers import Tier
from ..base import Continuation, Continuations
from ..shared import MARKER_TTL, ProcessConnection, marker_name, tier_queues


class AmqpContinuations(ProcessConnection, Continuations):
    # A channel is either in confirm mode or in a transaction: this connection's are not in confirm mode.
    transport_options = {"confirm_publish": False}

    _follower: Any = None

    def list_subqueues(self, app: Any, settings: PrioSettings) -> list[str]:
        """The registry's sub-queues (they exist: declared before they were announced), followed on this
        process's connection: its first call reads what is there, later ones only what arrived since."""
        from .registry import RegistryFollower

        conn = self.connection(app)
        follower, quiet = self._follower, 0.002  # what arrived since is in the socket's buffer already
        if follower is None or follower.connection is not conn or follower.pid != os.getpid():
            follower, quiet = RegistryFollower(settings), 0.05
            follower.start(conn.connection)
            follower.connection, follower.pid = conn, os.getpid()
            self._follower = follower
        try:
            follower.catch_up(conn, quiet)
        except conn.connection_errors:
            self.forget()
            self._follower = None
            raise
        return list(follower.names)

    def _with_channel(self, app: Any, work: Callable[[Any], Any]) -> Any:
        conn = self.connection(app)
        try:
            channel = conn.channel()
            try:
                return work(channel)
            finally:
                if channel.is_open:
                    channel.close()
        except conn.connection_errors:
            self.forget()
            raise

    def publish(self, app: Any, settings: PrioSettings, continuation: Continuation) -> None:
        from kombu import Producer

        marker = marker_name(settings, continuation.task_id)
        options = _aging_expiration(settings, continuation.tier, continuation.enqueued_at)

        def work(channel: Any) -> None:
            channel.queue_declare(
                queue=marker, durable=True, auto_delete=False, arguments={"x-expires": MARKER_TTL * 1000}
            )
            channel.tx_select()
            continuation.send(Producer(channel, auto_declare=False), **options)
            channel.basic_publish(
                channel.prepare_message(b"", properties={"delivery_mode": 2}), exchange="", routing_key=marker
            )
            channel.tx_commit()

        self._with_channel(app, work)

    def committed(self, app: Any, settings: PrioSettings, task_id: str) -> int:
        from amqp.exceptions import NotFound

        def work(channel: Any) -> int:
            try:
                return channel.queue_declare(queue=marker_name(settings, task_id), passive=True).message_count
            except NotFound:
                return 0

        return self._with_channel(app, work)

    def waiting(self, app: Any, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier``: a passive declare per queue (they exist: workers declared them)."""
        from amqp.exceptions import NotFound

        names = tier_queues(settings, tier, self.subqueues(app, settings))

        def work(channel: Any) -> int:
            total = 0
            for name in names:
                try:
                    total += channel.queue_declare(queue=name, passive=True).message_count
                except NotFound:  # the channel is closed by the broker: nothing more to ask on it
                    break
            return total

        return self._with_channel(app, work)


def _aging_expiration(settings: PrioSettings, tier: Tier, enqueued_at: Any) -> dict[str, float]:
    """RabbitMQ ages by time in queue: the continuation expires (is promoted) when the first publish would have."""
    threshold = settings.aging[tier]
    if threshold is None or not isinstance(enqueued_at, (int, float)):
        return {}
    return {"expiration": max(threshold - (time.time() - enqueued_at), 0.001)}
