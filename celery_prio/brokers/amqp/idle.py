"""An idle RabbitMQ worker waits on consumers instead of polling its queues with ``basic_get``.

When a fetch finds every queue of the scheduler's order empty and the
worker still has a free slot, it starts a consumer (prefetch 1, ``nowait``:
no round trip) on each of those queues and its event loop sleeps: RabbitMQ
pushes the next message published to any of them. A queue watched so is
known to be empty as long as its consumer has been pushed nothing, so a
fetch asks it nothing (a slot that frees while nothing arrived costs no
broker call at all). A consumer that is pushed a message is cancelled at
once: the fetch loop takes the message through the scheduler's order as
always (the queues before it that are not watched are still asked by
``basic_get``), and the worker holds at most that one message, for no longer
than the fetch it wakes. Whatever else reaches it (two arrivals racing a
cancel, or a message of a tier the scheduler does not ask for this slot)
goes straight back to its queue, its consumer gone. Every consumer is
cancelled when a fetch fills the worker's last free slot, so nothing is
pushed to a worker that could not run it: the default's promise of holding
nothing another worker could run holds. Slots also fill without a fetch (a
task whose ETA came, a batch topping up): a message pushed to a worker with
no free slot goes back at once and every consumer is cancelled.

Not on quorum queues: a message given back counts toward a quorum queue's
delivery limit, so idle workers there poll as before.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp.basic_message import Message as AmqpMessage

logger = logging.getLogger(__name__)

#: Consumers one idle worker starts at most (in the order a fetch asks its queues); where a worker serves
#: more, the rest are asked by ``basic_get`` every ``IDLE_RECHECK`` seconds.
IDLE_CONSUMERS_MAX = 64
#: Seconds between looks at the queues an idle worker has no consumer on (more than ``IDLE_CONSUMERS_MAX``).
IDLE_RECHECK = 1.0


class IdleWait:
    """Consumers on the queues an idle worker waits on; a push wakes the fetch loop."""

    def __init__(self, on_arrival: Callable[[], None], has_room: Callable[[], bool] = lambda: True) -> None:
        self.on_arrival = on_arrival
        self.has_room = has_room  # a free slot now (slots also fill without a fetch)
        self.channel: AmqpChannel | None = None
        self._tags = itertools.count(1)
        self._tag_of: dict[str, str] = {}  # queue -> its live consumer's tag
        self._queue_of: dict[str, str] = {}  # consumer tag -> queue
        self._hand: dict[str, deque[Any]] = {}  # queue -> messages pushed and not taken yet
        self.waits = 0  # consumers started (reported; one per queue per idle spell)

    @property
    def waiting(self) -> bool:
        return bool(self._tag_of)

    @property
    def held(self) -> int:
        return sum(len(d) for d in self._hand.values())

    def holds(self, queue: str) -> bool:
        return bool(self._hand.get(queue))

    def watches(self, queue: str) -> bool:
        """A consumer waits on ``queue`` and was pushed nothing: it is empty (for this worker) right now."""
        return queue in self._tag_of

    def start(self, channel: AmqpChannel, queues: Iterable[str]) -> None:
        """Wait on ``queues`` (a consumer each, prefetch 1; those already watched keep theirs)."""
        if channel is not self.channel:  # first wait, or a failed declare replaced the channel
            self.channel, self._tag_of, self._queue_of, self._hand = channel, {}, {}, {}
            channel.basic_qos(0, 1, False)  # every consumer started on it: one message in flight
        for queue in queues:
            if queue in self._tag_of:
                continue
            tag = f"prio-idle-{next(self._tags)}"
            channel.basic_consume(
                queue=queue, consumer_tag=tag, callback=self._delivered, on_cancel=self._cancelled, nowait=True
            )
            self._tag_of[queue], self._queue_of[tag] = tag, queue
            self.waits += 1

    def _delivered(self, raw: AmqpMessage) -> None:
        """A push (from inside ``drain_events``): its consumer goes, the message waits for the fetch it wakes."""
        queue = self._queue_of.get(raw.delivery_info.get("consumer_tag"))
        if queue is None:  # a consumer cancelled meanwhile: never keep what nobody takes
            self.channel.basic_reject(raw.delivery_tag, requeue=True)
            return
        if not self.has_room():  # busy since it started waiting: back for another worker, and wait no more
            self.channel.basic_reject(raw.delivery_tag, requeue=True)
            self.end()
            return
        self._cancel(queue)
        self._hand.setdefault(queue, deque()).append(raw)
        self.on_arrival()

    def _cancelled(self, tag: str) -> None:
        """RabbitMQ cancelled a consumer (its queue was deleted): the fetch loop looks again."""
        queue = self._queue_of.pop(tag, None)
        if queue is not None:
            self._tag_of.pop(queue, None)
            self.on_arrival()

    def _cancel(self, queue: str) -> None:
        """``nowait``: a delivery still in flight for it finds no callback, and py-amqp gives it back itself."""
        tag = self._tag_of.pop(queue, None)
        if tag is None:
            return
        self._queue_of.pop(tag, None)
        try:
            self.channel.basic_cancel(tag, nowait=True)
        finally:
            self.channel.callbacks.pop(tag, None)
            self.channel.cancel_callbacks.pop(tag, None)

    def end(self) -> None:
        """Cancel every consumer: the worker is busy, or stops."""
        for queue in list(self._tag_of):
            self._cancel(queue)

    def take(self, queue: str) -> AmqpMessage:
        return self._hand[queue].popleft()

    def give_back(self) -> None:
        """Whatever was pushed and not taken goes back to its queue, where it was."""
        hand, self._hand = self._hand, {}
        for messages in hand.values():
            for raw in messages:
                self.channel.basic_reject(raw.delivery_tag, requeue=True)

    def stop(self) -> None:
        try:
            self.end()
            self.give_back()
        except Exception as exc:  # the channel is gone (connection lost): RabbitMQ requeued them itself
            logger.info("celery-prio: idle consumers not cancelled (%r): the channel is closed", exc)
            self._tag_of, self._queue_of, self._hand = {}, {}, {}
