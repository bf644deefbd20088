"""Continuations of sliced tasks on RabbitMQ, recorded in one stream for the whole app.

A run that yields publishes its continuation and, in the same AMQP
transaction, appends ``{task id, generation}`` to the stream
``<prefix>.slices``; only then is its own message acked. A crash between
the two leaves the original in its queue, and RabbitMQ gives it back marked
redelivered (or, aged through a dead-letter exchange, with ``x-death``).
Only such a copy can be stale, so only such a copy reads the stream (to a
marker appended then, so nothing committed before is missed) for its id: a
check per crash, not per continuation, and no queue per task. It reads from
the task's first publish on (less ``CLOCK_SLACK``, for clocks apart), not
the whole stream: what it reads is the app's continuations during the task's
own life. The stream keeps a day of records (``MARKER_TTL``) and at most
``JOURNAL_MAX_BYTES``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ...headers import SLICE_GENERATION, SLICE_ID
from ...settings import PrioSettings
from ...tiers import Tier
from ..publishing import Continuation, Continuations
from ..shared import MARKER_TTL, ProcessConnection, tier_queues
from .registry import read_to_marker

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel

#: The slices journal keeps at most this many bytes (its records are about 100 bytes each).
JOURNAL_MAX_BYTES = 64 * 1024 * 1024
#: Seconds a stale-copy check may wait for the journal's next record (a long journal is read to its end).
JOURNAL_READ_TIMEOUT = 10.0
#: Seconds before a task's first publish that its stale-copy check starts reading at (publishers' and the
#: broker's clocks may differ by this much).
CLOCK_SLACK = 300.0


def journal_name(settings: PrioSettings) -> str:
    return f"{settings.queue_prefix}.slices"


def declare_journal(channel: AmqpChannel, settings: PrioSettings) -> None:
    channel.queue_declare(
        queue=journal_name(settings),
        durable=True,
        auto_delete=False,
        arguments={
            "x-queue-type": "stream",
            "x-max-age": f"{MARKER_TTL}s",
            "x-max-length-bytes": JOURNAL_MAX_BYTES,
            "x-stream-max-segment-size-bytes": JOURNAL_MAX_BYTES // 8,  # retention drops whole segments
        },
    )


T = TypeVar("T")


class AmqpContinuations(ProcessConnection, Continuations):
    # A channel is either in confirm mode or in a transaction: this connection's are not in confirm mode.
    transport_options = {"confirm_publish": False}

    _follower: Any = None

    def list_subqueues(self) -> list[str]:
        """The registry's sub-queues (they exist: declared before they were announced), followed on this
        process's connection: its first call reads what is there, later ones only what arrived since."""
        from .registry import RegistryFollower

        conn = self.connection()
        follower, quiet = self._follower, 0.002  # what arrived since is in the socket's buffer already
        if follower is None or follower.connection is not conn or follower.pid != os.getpid():
            follower, quiet = RegistryFollower(self.settings), 0.05
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

    def _with_channel(self, work: Callable[[AmqpChannel], T]) -> T:
        conn = self.connection()
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

    def publish(self, continuation: Continuation) -> None:
        from kombu import Producer

        settings = self.settings
        options = aging_expiration(settings, continuation.tier, continuation.enqueued_at)
        record = {SLICE_ID: continuation.task_id, SLICE_GENERATION: continuation.generation, "at": time.time()}

        def work(channel: AmqpChannel) -> None:
            declare_journal(channel, settings)
            channel.tx_select()
            continuation.send(Producer(channel, auto_declare=False), **options)
            channel.basic_publish(
                channel.prepare_message(b"", properties={"delivery_mode": 2}, headers=record),
                exchange="",
                routing_key=journal_name(settings),
            )
            channel.tx_commit()

        self._with_channel(work)

    def committed(self, task_id: str, since: float = 0) -> int:
        """The highest generation the journal holds for ``task_id`` (read to its end: exact, and costs a read
        of the journal from ``since`` on, or all of it; asked only after a crash)."""
        highest = 0

        def on_record(headers: dict) -> None:
            nonlocal highest
            generation = headers.get(SLICE_GENERATION)
            if headers.get(SLICE_ID) == task_id and isinstance(generation, int) and not isinstance(generation, bool):
                highest = max(highest, generation)

        settings, conn = self.settings, self.connection()
        try:
            read_to_marker(
                conn.connection,
                journal_name(settings),
                lambda channel: declare_journal(channel, settings),
                on_record,
                JOURNAL_READ_TIMEOUT,
                since=max(0.0, since - CLOCK_SLACK) if since else 0,
            )
        except conn.connection_errors:
            self.forget()
            raise
        return highest

    def stale(self, task_id: str, generation: int, redelivered: bool, since: float = 0) -> bool:
        # A copy that never went back to its queue is the one the last run published: never stale.
        return redelivered and self.committed(task_id, since) > generation

    def waiting(self, tier: Tier, changes: int | None = None) -> int:
        """Messages waiting in ``tier``: a passive declare per queue (they exist: workers declared them)."""
        from amqp.exceptions import NotFound

        names = tier_queues(self.settings, tier, self.subqueues(changes))

        def work(channel: AmqpChannel) -> int:
            total = 0
            for name in names:
                try:
                    total += channel.queue_declare(queue=name, passive=True).message_count
                except NotFound:  # the channel is closed by the broker: nothing more to ask on it
                    break
            return total

        return self._with_channel(work)


def aging_expiration(settings: PrioSettings, tier: Tier, enqueued_at: object) -> dict[str, float]:
    """RabbitMQ ages by time in queue: the continuation expires (is promoted) when the first publish would have."""
    threshold = settings.aging[tier]
    if threshold is None or not isinstance(enqueued_at, (int, float)):
        return {}
    return {"expiration": max(threshold - (time.time() - enqueued_at), 0.001)}
