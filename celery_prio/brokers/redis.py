"""Redis: tier queues are lists; LPUSH adds on the left, RPOP takes the oldest on the right."""

from __future__ import annotations

from typing import Any

from .base import BrokerAdapter


class RedisAdapter(BrokerAdapter):
    kind = "redis"

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.connection = app.connection_for_write()
        # The transport's own client: same URL, password, SSL and db as Celery uses.
        self.client = self.connection.default_channel.client

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def delete_queues(self, queues: list[str]) -> None:
        for name in queues:
            self.client.delete(name, f"_kombu.binding.{name}")

    def close(self) -> None:
        self.connection.release()


#: How often a worker returns messages whose consumer died (unacked for longer
#: than the visibility timeout) to their queues.
RESTORE_INTERVAL = 10.0


def restore_expired_unacked(channel: Any) -> None:
    """Put back messages a dead worker took but never acked.

    kombu does this only for channels with ``basic_consume`` subscriptions;
    a celery-prio worker fetches with ``basic_get`` and so must ask itself.
    The scan is guarded by kombu's Redis mutex, so workers can all call it.
    """
    try:
        channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)
    except channel.connection_errors:
        pass  # broken connection: the consumer reconnects, the next round retries
