"""Continuations of sliced tasks on Redis: the continuation's LPUSH and ``SET <prefix>.slice.<id> <n>``
in one MULTI/EXEC (the transport's ``_put`` does both when a marker is pending)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...tiers import Tier
from ..publishing import Continuation, Continuations
from ..shared import MARKER_TTL, ProcessConnection, marker_name, tier_queues
from .transport import pending_marker

if TYPE_CHECKING:
    from redis import Redis


T = TypeVar("T")


class RedisContinuations(ProcessConnection, Continuations):
    every_task_sjf = True  # one pipelined LLEN each: a missing list costs nothing

    def _client(self) -> Redis:
        return self.connection().default_channel.client

    def publish(self, continuation: Continuation) -> None:
        # Aging on Redis reads the enqueue stamp the continuation carries: nothing to adjust.
        pending_marker.value = (marker_name(self.settings, continuation.task_id), continuation.generation, MARKER_TTL)
        try:
            continuation.send()
        finally:
            left = pending_marker.value
            pending_marker.value = None
        if left is not None:
            raise RuntimeError("celery-prio: the continuation was not published through celery-prio's Redis transport")

    def committed(self, task_id: str) -> int:
        raw = self.guarded(lambda client: client.get(marker_name(self.settings, task_id)))
        try:
            return int(raw or 0)
        except ValueError:  # anyone can write to Redis: an unreadable marker marks nothing stale
            return 0

    def waiting(self, tier: Tier, changes: int | None = None) -> int:
        """Messages waiting in ``tier`` (one round trip): asked by a sliced task at an element boundary."""

        names = tier_queues(self.settings, tier, self.subqueues(changes))

        def count(client: Redis) -> int:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.llen(name)
            return sum(int(n) for n in pipe.execute())

        return self.guarded(count)

    def list_subqueues(self) -> list[str]:
        from .transport import registered_subqueues

        registry = self.settings.subqueue_registry
        return self.guarded(lambda client: registered_subqueues(client, registry))

    def guarded(self, work: Callable[[Redis], T]) -> T:
        conn = self.connection()
        try:
            return work(self._client())
        except conn.connection_errors:
            self.forget()
            raise
