"""RabbitMQ (AMQP 0-9-1 through py-amqp)."""

from __future__ import annotations

from typing import Any

from amqp.exceptions import NotFound

from .base import BrokerAdapter


class AmqpAdapter(BrokerAdapter):
    kind = "amqp"

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.connection = app.connection_for_write()
        self.connection.ensure_connection(max_retries=3)

    def _channel(self):
        return self.connection.default_channel

    def depth(self, queue: str) -> int:
        try:
            return int(self._channel().queue_declare(queue=queue, passive=True).message_count)
        except NotFound:
            self.connection.close()  # a failed passive declare closes the channel
            return 0

    def delete_queues(self, queues: list[str]) -> None:
        channel = self._channel()
        for name in queues:
            channel.queue_delete(queue=name)
            channel.exchange_delete(exchange=name)

    def close(self) -> None:
        self.connection.release()
