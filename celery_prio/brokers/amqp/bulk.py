"""RabbitMQ bulk publish: a chunk's frames written in one go, its confirms collected together."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import QueueFull
from ...settings import PrioSettings
from ...tiers import Tier
from ..publishing import BulkSession
from ..shared import fast_json

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection, Message


class AmqpBulkSession(BulkSession):
    """A chunk's publishes are written in one go (``amqp_wire``) and their confirms collected together.

    One confirm window per chunk instead of one round trip per message. With
    ``reject-publish`` RabbitMQ nacks each message over the cap; the
    session reports exactly which ones.
    """

    CONFIRM_TIMEOUT = 60.0

    def __init__(
        self,
        app: Celery,
        connection: Connection,
        settings: PrioSettings,
        tier: Tier,
        queue: str | None,
        refusal_figures: Callable[[Tier, str | None], tuple[int | None, float]],
    ) -> None:
        super().__init__(app, connection, settings, tier, queue)
        self.refusal_figures = refusal_figures  # the app publisher's: one connection for every refusal
        # The tier queue through its own exchange (as apply_async); a sub-queue through the default one.
        self.exchange = self.queue if queue is None else ""
        self.connection = connection
        self.channel.confirm_select()
        self._next_tag = 1
        self._pending: set[int] = set()
        self._nacked: set[int] = set()
        self.channel.events["basic_ack"].add(self._on_ack)
        self.channel.events["basic_nack"].add(self._on_nack)
        self._frames: Any = None  # amqp_wire.PublishFrames, from the first message
        self._shared_kwargs: tuple[Any, str] = ({}, "{}")

    def prepare(self, message: Message) -> tuple[bytes, str, dict[str, Any]]:
        """``(body, correlation_id, headers that differ)`` of one call; what the calls share is prepared once."""
        headers = message.headers
        if self._frames is None:
            from .wire import PublishFrames

            prepared = super().prepare(message)  # kombu's own message, once: its properties and encoding
            properties = dict(prepared.properties)
            properties.pop("application_headers")
            properties.pop("correlation_id", None)
            shared = {k: v for k, v in headers.items() if k not in self.VARIABLE_HEADERS}
            self._frames = PublishFrames(
                self.channel.channel_id,
                self.connection.connection.frame_max,
                self.exchange,
                self.queue,
                properties,
                shared,
            )
            self._shared_kwargs = (message.body[1], fast_json(message.body[1]))
        shared_kwargs, shared_kwargs_json = self._shared_kwargs
        if self.serializer == "json":
            args, kwargs, embed = message.body
            kwargs_json = shared_kwargs_json if kwargs is shared_kwargs else fast_json(kwargs)
            body: Any = f"[{fast_json(args)}, {kwargs_json}, {fast_json(embed)}]"
        else:
            body = super().prepare(message).body
        if isinstance(body, str):
            body = body.encode("utf-8")
        return body, headers["id"], {k: headers[k] for k in self.VARIABLE_HEADERS if k in headers}

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        done = [t for t in self._pending if t <= tag] if multiple else [tag] if tag in self._pending else []
        self._pending.difference_update(done)
        return done

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._nacked.update(self._settle(delivery_tag, multiple))

    def publish(self, messages: list[Any]) -> list[bool]:
        return self.collect(self.send(self.encode(messages)))

    def encode(self, messages: list[Any]) -> tuple[bytearray, list[int]]:
        """The chunk's frames (``amqp_wire``) and where each message's end in them."""
        out, ends = bytearray(), []
        for message in messages:
            body, correlation_id, variable = self.prepare(message)
            self._frames.add(out, body, correlation_id, variable)
            ends.append(len(out))
        return out, ends

    def send(self, encoded: tuple[bytearray, list[int]]) -> tuple[int, int, int]:
        """Write what fits of the chunk in one go; ``(first delivery tag, sent, chunk size)``."""
        out, ends = encoded
        count = self._room(len(ends))
        first = self._next_tag
        if count:
            amqp_connection = self.connection.connection
            amqp_connection.transport.write(memoryview(out)[: ends[count - 1]])
            amqp_connection.bytes_sent += 1  # what py-amqp's heartbeat check counts (writes, not bytes)
        self._next_tag += count
        self._pending.update(range(first, self._next_tag))
        return first, count, len(ends)

    def collect(self, ticket: tuple[int, int, int]) -> list[bool]:
        """Wait for the confirms of a sent chunk: per message, acked (True) or nacked / not sent (False)."""
        first, count, size = ticket
        end = first + count
        deadline = time.monotonic() + self.CONFIRM_TIMEOUT
        while self._pending and min(self._pending) < end:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"RabbitMQ did not confirm {len(self._pending)} publishes to {self.queue}")
            self.connection.drain_events(timeout=left)
        return [tag not in self._nacked for tag in range(first, end)] + [False] * (size - count)

    def _room(self, wanted: int) -> int:
        """How many of a chunk to send: all of it, except into a capped quorum queue.

        A quorum queue enforces its cap only after the fact (see
        ``quorum_arguments``): a chunk in flight together would overshoot it
        by up to the chunk. So the depth is read first and only what fits is
        sent; at the cap, one, for RabbitMQ to decide (another process may
        have drained it since the depth was read).
        """
        if self.settings.queue_type != "quorum" or self.cap is None or self.settings.overflow[self.tier] != "reject":
            return wanted
        depth = self.channel.queue_declare(queue=self.queue, passive=True).message_count
        return min(wanted, max(1, self.cap - depth))

    def queue_full(self, accepted: int) -> QueueFull:
        depth, rate = self.refusal_figures(self.tier, self.queue)
        return QueueFull.from_drain_rate(self.tier, depth, rate)
