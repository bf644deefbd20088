"""Which pushed consumers may still have a message on its way (``prio_fetch = "consume"``).

RabbitMQ pushes a consumer of prefetch 1 its next message once Celery
settles (acks or rejects) the last one. Until then, and for a moment after,
the consumer's queue is not known to be empty. A ``basic_get`` of that queue
sent after the settle answers the question: RabbitMQ handles a channel's
methods in order, so a message in the queue at the settle was pushed or is
got, and one published later is pushed when it is published. A consumer is
"armed" when it is started or kept after its message was taken; it has
nothing on its way once such a ``basic_get`` found its queue empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel

#: Messages taken whose settle is awaited at most (a bound on bookkeeping that cannot grow in practice).
UNSETTLED_MAX = 4096


class SettleWatch:
    """Acks and rejects seen on the fetch channel, and the consumers proven to have nothing on its way."""

    def __init__(self) -> None:
        self._unsettled: dict[int, str] = {}  # delivery tag -> the consumer kept for its queue, until settled
        self._nothing_coming: set[str] = set()  # consumer tags

    def watch(self, channel: AmqpChannel) -> None:
        """Note each ack and reject sent on ``channel`` (Celery's, through kombu's message)."""
        ack, reject, unsettled = channel.basic_ack, channel.basic_reject, self._unsettled

        def basic_ack(delivery_tag: int, multiple: bool = False, argsig: str = "Lb") -> None:
            if multiple:
                unsettled.clear()  # never sent by Celery; settles every earlier one
            else:
                unsettled.pop(delivery_tag, None)
            ack(delivery_tag, multiple, argsig)

        def basic_reject(delivery_tag: int, requeue: bool, argsig: str = "Lb") -> None:
            unsettled.pop(delivery_tag, None)
            reject(delivery_tag, requeue, argsig)

        channel.basic_ack, channel.basic_reject = basic_ack, basic_reject  # type: ignore[method-assign]

    def kept(self, consumer: str, delivery_tag: int) -> None:
        """``consumer``'s message was taken and the consumer kept: armed until that message is settled."""
        self._nothing_coming.discard(consumer)
        if len(self._unsettled) > UNSETTLED_MAX:  # settled by a path not watched (cannot happen): forget
            self._unsettled.clear()
        self._unsettled[delivery_tag] = consumer

    def gone(self, consumer: str) -> None:
        """``consumer`` was cancelled, or was pushed its message (armed again only when kept)."""
        self._nothing_coming.discard(consumer)

    def on_its_way(self, armed: Mapping[str, float], now: float, window: float) -> bool:
        """A consumer in ``armed`` (tag -> when armed) armed within ``window`` without proof of nothing coming."""
        nothing = self._nothing_coming
        for tag, at in armed.items():  # noqa: SIM110 - a loop, not ``any``: asked per pushed queue per take
            if now - at < window and tag not in nothing:
                return True
        return False

    def found_empty(self, consumers: Iterable[str]) -> None:
        """A ``basic_get`` of their queue just answered empty: those whose last message was settled before it
        was sent (or that never had one) have nothing on its way."""
        waiting = set(self._unsettled.values())
        self._nothing_coming.update(tag for tag in consumers if tag not in waiting)


__all__ = ["UNSETTLED_MAX", "SettleWatch"]
