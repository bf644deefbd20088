"""Pieces both brokers' code uses: one connection per process, where a tier's work waits, JSON."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..headers import SLICE_MARKER_SUFFIX
from ..settings import PrioSettings
from ..tiers import Tier
from .publishing import Bound, Publisher

if TYPE_CHECKING:
    from kombu import Connection

MARKER_TTL = 24 * 3600


def marker_name(settings: PrioSettings, task_id: str) -> str:
    return f"{settings.queue_prefix}{SLICE_MARKER_SUFFIX}{task_id}"


class ProcessConnection(Bound):
    """A role bound to an app's publisher with one broker connection per process (pool children are forked:
    never share the parent's socket)."""

    transport_options: dict[str, Any] = {}

    def __init__(self, publisher: Publisher) -> None:
        super().__init__(publisher)
        self._conn: Connection | None = None
        self._pid = 0

    def connection(self) -> Connection:
        if self._conn is None or self._pid != os.getpid():
            self._conn = self.app.connection_for_write(transport_options=self.transport_options)
            self._pid = os.getpid()
        return self._conn

    def forget(self) -> None:
        self._conn = None  # reconnect on the next call

    _subqueues: tuple[float, list[str], int | None] | None = None

    def subqueues(self, changes: int | None = None) -> list[str]:
        """This app's sub-queues (listed, and realtime's shortest-first ones), at most every
        ``SUBQUEUE_LIST_TTL`` seconds per process, and again whenever ``changes`` (the worker's count of changes
        to the queues it serves) differs from the list's: asked at sliced tasks' element boundaries, where a
        per-call realtime task's new sub-queue must be seen at the next boundary, not a list's lifetime later.
        ``None`` (a caller with no count: a boost) leaves the list's lifetime alone to decide."""
        app, settings = self.app, self.settings
        now = time.monotonic()
        cached = self._subqueues
        moved = changes is not None and cached is not None and cached[2] != changes
        if cached is None or moved or now - cached[0] > SUBQUEUE_LIST_TTL or self._pid != os.getpid():
            try:
                names = self.list_subqueues()
            except Exception:  # a listing that fails leaves the last one in use
                names = self._subqueues[1] if self._subqueues else []
            if settings.sjf:
                from ..policy.routes import sjf_queues

                names = [*names, *sjf_queues(settings, app.tasks, every_task=self.every_task_sjf)]
            self._subqueues = (now, names, changes if changes is not None else cached[2] if cached else None)
        return self._subqueues[1]

    def list_subqueues(self) -> list[str]:
        raise NotImplementedError

    #: Counts every registered task's shortest-first queue (as the worker serves them: see ``sjf_queues``).
    every_task_sjf = False


SUBQUEUE_LIST_TTL = 2.0  # seconds a pool child reuses its list of a tier's sub-queues


def tier_queues(settings: PrioSettings, tier: Tier, subqueues: list[str]) -> list[str]:
    """Where ``tier``'s work waits: its queue, its front lane and those of ``subqueues`` that are its."""
    lane = settings.front_lanes().get(tier)
    names = [settings.queue_name(tier), *([lane] if lane else [])]
    names += [n for n in subqueues if settings.subqueue_of(n, tier) is not None]
    return list(dict.fromkeys(names))


def as_text(value: object) -> str:
    """A Redis reply (bytes) or any value as text; undecodable bytes replaced, never an error."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def fast_json(value: object) -> str:
    """The standard library's C encoder for plain data; kombu's (datetimes, UUIDs, ...) for the rest."""
    try:
        return json.dumps(value)
    except TypeError:
        from kombu.utils.json import dumps

        return dumps(value)


def tier_full(tier: Tier, cap: int | None) -> str:
    """Why a boost into ``tier`` was refused: it holds its cap already (a boost is admitted like a publish)."""
    return f"{tier.label} is full: it holds its cap of {cap} messages (prio_max_length); the task stays where it is"


def boost_lane(settings: PrioSettings, tier: Tier) -> str:
    """The queue a task lifted into ``tier`` goes to (its front lane, served before the tier's queue)."""
    lane = settings.front_lanes().get(tier)
    if lane is None:
        raise ConfigError(f"celery_prio.boost(): tier {tier.label!r} has no front lane; boosts need prio_inherit=True")
    return lane
