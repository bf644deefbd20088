"""Which task copies are stale: the worker's memory of boosts on RabbitMQ. Pure, no Celery import.

A RabbitMQ queue cannot give up a message from its middle, so a boost there
publishes a lifted copy of the task (same id, generation n) and the
original stays where it was. Before the copy is published, every live
worker is told (``prio_supersede``, a broadcast with replies) and records
``id -> n`` here; a worker that starts later reads the records from the
boost journal before its first fetch (``brokers/amqp_boost.py``). A worker
that fetches a copy of ``id`` with a generation below the recorded one acks
it without running it.

Records are kept :data:`KEEP_FOR` seconds (the journal's retention) and at
most :data:`MAX_RECORDS` (oldest dropped first), as Celery keeps revoked ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

KEEP_FOR = 24 * 3600.0
MAX_RECORDS = 100_000


def generation_of(value: Any) -> int:
    """The boost generation a message header carries (0: an original, or an unreadable header)."""
    gen = value.get("gen") if isinstance(value, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen > 0 else 0


class Superseded:
    """``task id -> (generation, recorded at)``; copies of a lower generation are stale."""

    def __init__(self, keep_for: float = KEEP_FOR, max_records: int = MAX_RECORDS) -> None:
        self.keep_for = keep_for
        self.max_records = max_records
        self._records: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.skipped = 0  # stale copies acked unrun by this worker

    def __len__(self) -> int:
        return len(self._records)

    def record(self, task_id: str, generation: int, now: float) -> None:
        """Remember that copies of ``task_id`` below ``generation`` are stale (a higher record stays)."""
        if not isinstance(task_id, str) or not isinstance(generation, int) or generation <= 0:
            return
        known = self._records.get(task_id)
        if known is not None and known[0] >= generation:
            return
        self._records[task_id] = (generation, now)
        self._records.move_to_end(task_id)
        self._expire(now)

    def retract(self, task_id: str, generation: int) -> None:
        """Forget a record made for a boost that did not happen (a worker already held the task)."""
        known = self._records.get(task_id)
        if known is not None and known[0] == generation:
            del self._records[task_id]

    def is_stale(self, task_id: Any, generation: int) -> bool:
        """Called for every fetched message: one dict lookup."""
        if not self._records or not isinstance(task_id, str):
            return False
        known = self._records.get(task_id)
        return known is not None and generation < known[0]

    def snapshot(self, now: float) -> list[list[Any]]:
        """``[[id, generation, recorded at], ...]``, oldest first (what a starting peer merges)."""
        self._expire(now)
        return [[task_id, gen, at] for task_id, (gen, at) in self._records.items()]

    def merge(self, records: Iterable[Any], now: float) -> int:
        """Take a peer's snapshot; malformed rows are skipped. Returns how many were new or higher."""
        taken = 0
        for row in records if isinstance(records, (list, tuple)) else ():
            if not isinstance(row, (list, tuple)) or len(row) != 3:
                continue
            task_id, gen, at = row
            if not isinstance(at, (int, float)) or isinstance(at, bool) or not now - self.keep_for < at <= now + 60:
                continue
            before = self._records.get(task_id) if isinstance(task_id, str) else None
            self.record(task_id, gen, min(float(at), now))
            if self._records.get(task_id) != before:
                taken += 1
        return taken

    def _expire(self, now: float) -> None:
        while self._records:
            task_id, (_, at) = next(iter(self._records.items()))
            if len(self._records) <= self.max_records and now - at < self.keep_for:
                break
            del self._records[task_id]


#: The worker process's records (its main process fetches; the control commands and mingle write).
superseded = Superseded()
