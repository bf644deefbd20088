"""RabbitMQ: sub-queues found through the broker itself, and which tiers the live workers serve.

RabbitMQ cannot list queues over AMQP (only its optional management plugin
can), so a worker could not find a sub-queue it was not told of: a per-call
realtime task's shortest-first queue or a new tenant's queue sat unserved
when the plugin was off, as it is in the stock image. Here:

* **The registry** ``<prefix>.subqueues`` is a stream. A publisher declares a
  sub-queue, then appends its name (with a confirm) before the first message
  goes to it, once per name per process (again every
  ``Publisher.REINTRODUCE_AFTER``, so the stream's age limit never forgets a
  queue in use). Every worker follows
  the stream from its first record on a channel of its own: RabbitMQ pushes
  each new name as it is appended, so an idle worker serves a new sub-queue
  within milliseconds of its first publish. Records are data: a name is
  taken only if it is one of this app's sub-queue names.
* **Presence** ``<prefix>.serving.<tier>``: a queue that never holds a
  message, consumed by every live worker that serves the tier, so its
  consumer count (a passive declare, no management API) is how many workers
  serve the tier. A queue with messages whose tier has none is unserved.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import amqp
from amqp.exceptions import NotFound

from ...settings import PrioSettings
from ...tiers import TIERS, Tier

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp import Connection as AmqpConnection
    from kombu import Connection, Message

#: The registry keeps a name this long after its last announcement, and at most this many bytes.
REGISTRY_MAX_AGE = "7D"
REGISTRY_MAX_BYTES = 64 * 1024 * 1024
#: Registry records in flight to one follower (a stream consumer needs a prefetch).
FOLLOW_PREFETCH = 1000
#: The task directory's bounds: names kept per follower, and the longest name taken.
MAX_TASK_NAMES = 100_000
MAX_TASK_NAME = 500
#: Seconds a one-off read of the registry (``read_registry``) may take.
READ_TIMEOUT = 10.0


def registry_name(settings: PrioSettings) -> str:
    return settings.subqueue_registry


def declare_registry(channel: AmqpChannel, settings: PrioSettings) -> None:
    channel.queue_declare(
        queue=registry_name(settings),
        durable=True,
        auto_delete=False,
        arguments={"x-queue-type": "stream", "x-max-age": REGISTRY_MAX_AGE, "x-max-length-bytes": REGISTRY_MAX_BYTES},
    )


def announce(channel: AmqpChannel, settings: PrioSettings, name: str) -> None:
    """Append sub-queue ``name`` to the registry, confirmed by the broker before returning."""
    declare_registry(channel, settings)
    channel.basic_publish_confirm(
        amqp.Message(b"", application_headers={"subqueue": name, "at": time.time()}, delivery_mode=2),
        exchange="",
        routing_key=registry_name(settings),
    )


def announce_tasks(channel: AmqpChannel, settings: PrioSettings, names: list[str]) -> None:
    """Append one record naming the tasks a worker has registered (the fleet's task directory), confirmed."""
    declare_registry(channel, settings)
    channel.basic_publish_confirm(
        amqp.Message(json.dumps(names).encode(), application_headers={"tasks": 1, "at": time.time()}, delivery_mode=2),
        exchange="",
        routing_key=registry_name(settings),
    )


def accepted_tasks(headers: Any, body: Any) -> list[str]:
    """The task names a directory record lists (anyone can append to a stream: anything else is ignored)."""
    if not isinstance(headers, dict) or "tasks" not in headers:
        return []
    try:
        names = json.loads(body)
    except (TypeError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names[:MAX_TASK_NAMES] if isinstance(n, str) and 0 < len(n) <= MAX_TASK_NAME]


def accepted_name(settings: PrioSettings, headers: Any) -> str | None:
    """The sub-queue a registry record names, if it is one of this app's (anyone can append to a stream)."""
    name = headers.get("subqueue") if isinstance(headers, dict) else None
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return name if settings.is_subqueue(name) else None


class RegistryFollower:
    """Every sub-queue name in the registry, as RabbitMQ pushes them, on a channel of its own.

    On a worker's connection the event loop delivers the records and
    ``on_new`` is called from inside it (so it must make no broker call);
    on a connection of its own, ``catch_up`` reads what has arrived.
    """

    def __init__(self, settings: PrioSettings, on_new: Callable[[list[str]], None] = lambda names: None) -> None:
        self.settings = settings
        self.on_new = on_new
        self.names: dict[str, None] = {}  # insertion-ordered set
        self.tasks: set[str] = set()  # every task a worker of the fleet recorded (``announce_tasks``)
        self.version = 0  # bumped with every new name
        self.problem: str | None = "not started"
        self.channel: Any = None

    def start(self, connection: AmqpConnection) -> None:
        """Follow the registry on a new channel of ``connection`` (a py-amqp connection)."""
        try:
            channel = connection.channel()
            declare_registry(channel, self.settings)
            channel.basic_qos(0, FOLLOW_PREFETCH, False)
            channel.basic_consume(
                registry_name(self.settings),
                callback=self._record,
                on_cancel=self._cancelled,
                arguments={"x-stream-offset": "first"},
            )
        except Exception as exc:
            self.problem = f"cannot follow the sub-queue registry {registry_name(self.settings)}: {exc!r}"
            raise
        self.channel, self.problem = channel, None

    def _record(self, message: Message) -> None:
        self.channel.basic_ack(message.delivery_tag)
        if len(self.tasks) < MAX_TASK_NAMES:
            self.tasks.update(accepted_tasks(message.headers, message.body))
        name = accepted_name(self.settings, message.headers)
        if name is not None and name not in self.names:
            self.names[name] = None
            self.version += 1
            self.on_new([name])

    def _cancelled(self, consumer_tag: Any) -> None:
        # The stream was deleted (or the broker cancelled us): names found so far stay served.
        self.problem = f"the broker cancelled this worker's follower of {registry_name(self.settings)}"
        self.channel = None

    def catch_up(self, connection: Connection | AmqpConnection, quiet: float = 0.02) -> None:
        """Read the records delivered so far on ``connection`` (a kombu or py-amqp connection of its own)."""
        while True:
            try:
                connection.drain_events(timeout=quiet)
            except TimeoutError:
                return


def read_to_marker(
    connection: AmqpConnection,
    queue: str,
    declare: Callable[[AmqpChannel], None],
    on_record: Callable[[dict], None],
    timeout: float,
    since: float = 0,
) -> int:
    """Call ``on_record(headers)`` for every record of the stream ``queue``, up to a marker appended here,
    so nothing written before the call is missed. ``timeout`` bounds the wait for the *next* record, not
    the whole read: a long stream is read to its end. ``since`` (epoch seconds, by the broker's clock): start
    at the records appended from then on (RabbitMQ starts at the chunk holding that time), not at the first.
    ``connection``: a py-amqp connection of its own (this drains its events); ``declare(channel)`` declares
    the stream. Returns how many records were read."""
    channel = connection.channel()
    try:
        declare(channel)
        marker = uuid.uuid4().hex
        channel.basic_publish_confirm(
            amqp.Message(b"", application_headers={"marker": marker}), exchange="", routing_key=queue
        )
        done: list[bool] = []
        deadline = time.monotonic() + timeout
        read = 0

        def on_message(message: Message) -> None:
            nonlocal deadline, read
            deadline = time.monotonic() + timeout  # progress: however long the stream, read on to the marker
            channel.basic_ack(message.delivery_tag)
            headers = message.headers or {}
            if headers.get("marker") == marker:
                done.append(True)
            else:
                read += 1
                on_record(headers)

        channel.basic_qos(0, FOLLOW_PREFETCH, False)
        # A stream offset by time is an AMQP timestamp (py-amqp sends a datetime as one).
        offset: Any = datetime.fromtimestamp(since, tz=UTC) if since > 0 else "first"
        channel.basic_consume(queue, callback=on_message, arguments={"x-stream-offset": offset})
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"celery-prio: no record of {queue} for {timeout:g} s before its end")
            connection.drain_events(timeout=left)
        return read
    finally:
        if channel.is_open:
            channel.close()


def read_registry(connection: AmqpConnection, settings: PrioSettings) -> list[str]:
    """Every sub-queue name in the registry now (CLI, tests, cleanup)."""
    names: dict[str, None] = {}

    def on_record(headers: dict) -> None:
        name = accepted_name(settings, headers)
        if name is not None:
            names[name] = None

    read_to_marker(
        connection,
        registry_name(settings),
        lambda channel: declare_registry(channel, settings),
        on_record,
        READ_TIMEOUT,
    )
    return list(names)


class Presence:
    """This worker's consumers on ``<prefix>.serving.<tier>`` for the tiers it serves (kept in step)."""

    def __init__(self, settings: PrioSettings, arguments: dict[str, Any] | None) -> None:
        self.settings = settings
        self.arguments = arguments  # the queues' arguments (quorum on a cluster, like the fleet queue)
        self.channel: Any = None
        self._tags: dict[Tier, str] = {}

    def keep(self, connection: AmqpConnection, tiers: Iterable[Tier]) -> None:
        """Consume the presence queues of exactly ``tiers`` (cheap when nothing changed)."""
        wanted = set(tiers)
        if self.channel is None or not self.channel.is_open:
            self.channel, self._tags = connection.channel(), {}
        for tier in [t for t in self._tags if t not in wanted]:
            self.channel.basic_cancel(self._tags.pop(tier), nowait=True)
        for tier in [t for t in TIERS if t in wanted and t not in self._tags]:
            queue = self.settings.presence_queue(tier)
            self.channel.queue_declare(queue=queue, durable=True, auto_delete=False, arguments=self.arguments)
            self._tags[tier] = self.channel.basic_consume(queue=queue, no_ack=True, callback=lambda message: None)

    @property
    def tiers(self) -> set[Tier]:
        return set(self._tags)


def passive_declares(connection: AmqpConnection, names: list[str], probe: ProbeChannel | None = None) -> list[Any]:
    """RabbitMQ's declare-ok of each of ``names`` (its message and consumer counts), None for one that does not
    exist. On a probe channel of its own (``probe``'s, kept open between calls, where given): a passive declare
    of a missing queue closes its channel."""
    own = probe or ProbeChannel()
    try:
        return [own.declare(connection, name) for name in names]
    finally:
        if probe is None:
            own.close()


class ProbeChannel:
    """A channel for passive declares, kept open across calls (a worker reads depths every few seconds:
    opening and closing a channel each time would cost RabbitMQ more than the declares themselves)."""

    def __init__(self) -> None:
        self.channel: Any = None

    def get(self, connection: AmqpConnection) -> Any:
        """The open probe channel on ``connection`` (a new one after an error reply closed the last)."""
        if self.channel is None or not self.channel.is_open or self.channel.connection is not connection:
            self.channel = connection.channel()
        return self.channel

    def declare(self, connection: AmqpConnection, name: str) -> Any:
        try:
            return self.get(connection).queue_declare(queue=name, passive=True)
        except NotFound:
            self.channel = None  # RabbitMQ closed it
            return None

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None and channel.is_open:
            channel.close()


def serving_counts(connection: AmqpConnection, settings: PrioSettings) -> dict[Tier, int]:
    """Live workers per tier: the consumers of each presence queue (none where no worker ever served it)."""
    found = passive_declares(connection, [settings.presence_queue(t) for t in TIERS])
    return {tier: int(ok.consumer_count) if ok else 0 for tier, ok in zip(TIERS, found, strict=True)}


def existing_depths(connection: AmqpConnection, names: list[str], probe: ProbeChannel | None = None) -> list[int]:
    """Messages ready in each of ``names`` (0 for one that does not exist)."""
    return [int(ok.message_count) if ok else 0 for ok in passive_declares(connection, names, probe)]
