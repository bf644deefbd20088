"""``celery_prio.bulk``: publish many calls of one task at the seed's batch scale.

``apply_async`` publishes one message per call, and on RabbitMQ with a
rejecting tier waits for one confirm per call. A batch job of a million
items then spends most of its time enqueuing. ``bulk`` builds Celery's own
task messages (the workers see nothing different) and publishes them in
chunks: on Redis one atomic script call per chunk that also enforces the
tier's cap; on RabbitMQ the chunk's publishes in flight together and their
confirms collected once per chunk. The input is read lazily, one chunk at a
time, and task ids are derived from one base id and the item's position, so
the producer's memory stays flat for any number of items.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from ..errors import QueueFull
from ..headers import ENQUEUED_HEADER
from ..runtime import publisher_of
from ..settings import subqueue_name_problem
from ..tiers import TierName, parse_tier

if TYPE_CHECKING:
    from celery import Celery, Task
    from celery.result import AsyncResult

#: The apply_async options bulk understands; each applies to every item.
OPTIONS = ("kwargs", "expires", "time_limit", "soft_time_limit", "ignore_result", "countdown", "eta")


#: Longest argsrepr, as Celery's own (``amqp.argsrepr_maxsize``).
ARGSREPR_MAX = 1024


class TaskMessage(NamedTuple):
    headers: dict[str, object]
    properties: dict[str, object]
    body: tuple[Sequence[object], Mapping[str, object], dict[str, object]]  # args, kwargs, embed


def _short_repr(args: object) -> str:
    text = repr(args)
    return text if len(text) <= ARGSREPR_MAX else text[: ARGSREPR_MAX - 3] + "..."


@dataclass(frozen=True)
class BulkResult(Sequence[str]):
    """The task ids of a bulk publish, in input order, computed rather than stored.

    ``ids[i]`` is ``f"{base}-{i}"``; ``results()`` gives ``AsyncResult``s
    (fine for thousands; for millions iterate ids and ask the backend as you go).
    """

    app: Celery
    base: str
    count: int
    start: int = 0
    group_id: str | None = None  # set when the items were published as one group (group(...) through bulk)

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError(index)
        return f"{self.base}-{self.start + index}"

    def __iter__(self) -> Iterator[str]:
        return (f"{self.base}-{self.start + i}" for i in range(self.count))

    def results(self) -> list[AsyncResult]:
        return [self.app.AsyncResult(task_id) for task_id in self]


class BulkQueueFull(QueueFull):
    """A bulk publish stopped at a full tier: ``accepted`` says how many went in, and which."""

    def __init__(self, full: QueueFull, accepted: Sequence[str]) -> None:
        super().__init__(full.tier, full.waiting, full.retry_after)
        self.accepted = accepted
        self.args = (f"{full}; {len(accepted)} of the bulk publish accepted before it",)


def bulk(
    task: Task,
    args_iterable: Iterable[Sequence[object]],
    *,
    tier: TierName,
    subqueue: str | None = None,
    chunk: int = 1000,
    **options: object,
) -> BulkResult:
    """Publish ``task(*args)`` for every ``args`` of ``args_iterable`` into ``tier``, ``chunk`` at a time.

    Returns the task ids in input order. When the tier's cap refuses part of
    a chunk (``reject``), raises ``BulkQueueFull`` (a ``QueueFull``)
    whose ``accepted`` lists exactly the ids that were enqueued; nothing after
    the refusal is published. ``drop_oldest`` tiers take every item and
    dead-letter the oldest, as single publishes do.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"bulk() does not take {', '.join(unknown)}; options it applies to every item: {OPTIONS}")
    kwargs = options.pop("kwargs", None) or {}
    return publish_calls(task, ((args, kwargs) for args in args_iterable), tier, chunk, options, subqueue=subqueue)


def publish_calls(
    task: Task,
    calls: Iterable[tuple[Sequence[object], Mapping[str, object]]],
    tier: TierName,
    chunk: int,
    options: dict[str, object],
    group: bool = False,
    subqueue: str | None = None,
) -> BulkResult:
    """``bulk``'s engine: ``(args, kwargs)`` per call; ``group`` publishes them as one Celery group."""
    tier = parse_tier(tier)
    if subqueue is not None and subqueue_name_problem(subqueue):
        raise ValueError(f"bulk(): {subqueue_name_problem(subqueue)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number >= 1, got {chunk!r}")
    app = task._get_app()
    publishing = publisher_of(app)
    if publishing is None:
        raise RuntimeError("bulk() needs celery_prio.install(app) first")
    base = str(uuid.uuid4())
    group_id = str(uuid.uuid4()) if group else None  # Celery's group header; group_index per item
    if group_id is not None:
        options = {**options, "group_id": group_id}
    items = iter(calls)
    published = 0
    # One message built by Celery itself is the template; each item only
    # changes its id, args and argsrepr (as_task_v2 per item costs more than
    # the whole publish).
    template = app.amqp.as_task_v2(f"{base}-template", task.name, (), {}, reply_to=app.thread_oid, **options)
    embed = template.body[2]
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=3)
        session = publishing.bulk_session(connection, tier, subqueue)
        # One chunk in flight: the next one is built and encoded while the broker takes the last,
        # and sent only once the last is known to be in whole (nothing is sent after a refusal).
        in_flight: tuple[Any, int] | None = None  # (the session's ticket, how many items it carries)

        def settle() -> None:
            nonlocal in_flight, published
            if in_flight is None:
                return
            ticket, count = in_flight
            in_flight = None
            accepted = session.collect(ticket)
            if not all(accepted):
                ids = [f"{base}-{published + i}" for i, ok in enumerate(accepted) if ok]
                done = BulkResult(app, base, published)
                raise BulkQueueFull(session.queue_full(len(ids)), [*done, *ids])
            published += count

        while batch := list(itertools.islice(items, chunk)):
            stamp = time.time()
            first = published + (in_flight[1] if in_flight else 0)  # this chunk's first position
            messages = []
            for offset, (args, kwargs) in enumerate(batch):
                if not isinstance(args, (list, tuple)):
                    settle()  # what is in flight is in (or refused) before the error says how much went in
                    sent = f"{base}-0 .. {base}-{published - 1}" if published else "none"
                    raise TypeError(
                        f"item {first + offset} of bulk(): args must be a list or tuple, got {args!r} "
                        f"(published before it: {published} items, ids {sent})"
                    )
                task_id = f"{base}-{first + offset}"
                headers = {
                    **template.headers,
                    "id": task_id,
                    "root_id": task_id,
                    "argsrepr": _short_repr(args),
                    "kwargsrepr": _short_repr(kwargs),
                    ENQUEUED_HEADER: stamp,
                }
                if group_id is not None:
                    headers["group_index"] = first + offset
                properties = {**template.properties, "correlation_id": task_id}
                messages.append(TaskMessage(headers, properties, (args, kwargs, embed)))
            encoded = session.encode(messages)
            settle()
            in_flight = (session.send(encoded), len(batch))
        settle()
    return BulkResult(app, base, published, group_id=group_id)
