"""Which task copies are stale: the worker's memory of boosts on RabbitMQ. Pure, no Celery import.

A RabbitMQ queue cannot give up a message from its middle, so a boost there
publishes a lifted copy of the task (same id, generation n) and the
original stays where it was. In two phases, so that no crash loses the
task: before the copy is published every live worker is told
(``prio_supersede``, a broadcast with replies) and records ``id -> n`` as
*pending*; once the copy is on the broker the booster commits it. A worker
that starts later reads the records from the boost journal before its first
fetch (``brokers/amqp/boost.py``).

A worker that fetches a copy of ``id`` with a generation below a committed
record acks it without running it; below a pending one it waits for the
commit, at most until the record's deadline, and then runs it (the booster
died before its copy was published, or before it said so: the task runs,
perhaps twice, but is never lost).

Records are kept :data:`KEEP_FOR` seconds (the journal's retention) and at
most :data:`MAX_RECORDS` (oldest dropped first), as Celery keeps revoked ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

KEEP_FOR = 24 * 3600.0
#: Seconds a prepared boost stays pending at a worker without its commit (then the original runs).
PENDING_FOR = 5.0
MAX_RECORDS = 100_000


def generation_of(value: object) -> int:
    """The boost generation a message header carries (0: an original, or an unreadable header)."""
    gen = value.get("gen") if isinstance(value, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen > 0 else 0


#: Verdicts of :meth:`Superseded.verdict`.
RUN, STALE = "run", "stale"


class Superseded:
    """``task id -> (generation, recorded at, pending until or 0)``; copies of a lower generation are stale."""

    def __init__(self, keep_for: float = KEEP_FOR, max_records: int = MAX_RECORDS) -> None:
        self.keep_for = keep_for
        self.max_records = max_records
        self._records: OrderedDict[str, tuple[int, float, float]] = OrderedDict()
        self.skipped = 0  # stale copies acked unrun by this worker

    def __len__(self) -> int:
        return len(self._records)

    def record(self, task_id: str, generation: int, now: float, pending_for: float | None = None) -> None:
        """Remember that copies of ``task_id`` below ``generation`` are stale (a higher record stays);
        with ``pending_for``, only once committed, and not at all if no commit comes within that time."""
        if not isinstance(task_id, str) or not isinstance(generation, int) or generation <= 0:
            return
        if isinstance(generation, bool):
            return
        known = self._records.get(task_id)
        if known is not None and known[0] >= generation:
            return
        self._records[task_id] = (generation, now, now + pending_for if pending_for else 0.0)
        self._records.move_to_end(task_id)
        self._expire(now)

    def commit(self, task_id: str, generation: int, now: float) -> None:
        """The copy of ``generation`` is on the broker: lower copies are stale for good."""
        known = self._records.get(task_id)
        if known is None or known[0] < generation:
            self.record(task_id, generation, now)
        elif known[0] == generation:
            self._records[task_id] = (generation, known[1], 0.0)

    def retract(self, task_id: str, generation: int) -> None:
        """Forget a record made for a boost that did not happen (a worker already held the task)."""
        known = self._records.get(task_id)
        if known is not None and known[0] == generation:
            del self._records[task_id]

    def verdict(self, task_id: object, generation: int, now: float) -> str | float:
        """``RUN``, ``STALE``, or the seconds to wait for a pending boost's commit before asking again.
        Called for every fetched message: one dict lookup."""
        if not self._records or not isinstance(task_id, str):
            return RUN
        known = self._records.get(task_id)
        if known is None or generation >= known[0]:
            return RUN
        pending_until = known[2]
        if not pending_until:
            return STALE
        if now >= pending_until:  # never committed: the booster died; the task runs
            del self._records[task_id]
            return RUN
        return pending_until - now

    def is_stale(self, task_id: object, generation: int) -> bool:
        known = self._records.get(task_id) if isinstance(task_id, str) else None
        return known is not None and generation < known[0] and not known[2]

    def snapshot(self, now: float) -> list[list[str | int | float]]:
        """``[[id, generation, recorded at], ...]``, oldest first (what a starting peer merges; committed only)."""
        self._expire(now)
        return [[task_id, gen, at] for task_id, (gen, at, pending) in self._records.items() if not pending]

    def merge(self, records: Iterable[object], now: float, pending_for: float | None = None) -> int:
        """Take journal records (``[id, generation, at]``, or ``[id, generation, at, "pending"]`` for a boost
        not committed yet, held pending for ``pending_for`` from now); malformed rows are skipped. ``at``
        None: now (the journal's own retention, kept by the broker's clock, bounds their age, so no
        booster's clock is trusted). Returns how many were new or higher."""
        taken = 0
        for row in records if isinstance(records, (list, tuple)) else ():
            if not isinstance(row, (list, tuple)) or len(row) not in (3, 4):
                continue
            task_id, gen, at = row[:3]
            if at is None:
                at = now
            if not isinstance(at, (int, float)) or isinstance(at, bool) or not now - self.keep_for < at:
                continue
            before = self._records.get(task_id) if isinstance(task_id, str) else None
            pending = pending_for if len(row) == 4 and row[3] == "pending" else None
            self.record(task_id, gen, min(float(at), now), pending_for=pending)
            if self._records.get(task_id) != before:
                taken += 1
        return taken

    def _expire(self, now: float) -> None:
        while self._records:
            task_id, (_, at, _pending) = next(iter(self._records.items()))
            if len(self._records) <= self.max_records and now - at < self.keep_for:
                break
            del self._records[task_id]
