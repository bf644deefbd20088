"""Shared memory between a worker's main process and its pool children, for GPU time slices.

A sliced task (``celery_prio.slices``) runs in a pool child. Whether it may
yield depends on two things known in different places:

* the worker's slots and scheduler (main process): is every slot busy, and
  which higher tiers would the scheduler serve before this task's tier if
  the slot were free? The main process writes that here, per tier, as a set
  of *preemptors*, every few tens of ms (no broker call);
* whether one of those tiers has work waiting (the broker): the child asks
  the broker itself at an element boundary, only when its slice is used up
  and its tier has preemptors, so a waiting realtime task is seen at the
  next boundary, not one check interval later.

A child that sees N tasks waiting claims a yield only while fewer than N
yields are pending (not yet refilled by the main process), so one waiting
task frees one slot, not every slot. Children also write when they last
looked (the main process keeps preemptors up to date only while a sliced
task runs), count their yields (reported by the worker) and name the tier
they yielded for (the freed slot goes to it). The main process also counts
the changes to the queues it serves, so that a child lists a tier's
sub-queues again when one was found since its last list.

The memory is an anonymous shared mapping made by ``install()`` in the
process that becomes the worker's main process, before the pool forks, so
every child (also those re-forked by ``worker_max_tasks_per_child``) shares
it. Where it is not shared (a pool that does not fork from that process)
children see no preemptors and never yield: slicing degrades to running
straight through, never to a wrong yield.
"""

from __future__ import annotations

import mmap
import multiprocessing
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from ..tiers import TIERS, Tier

# Per tier: asked_at (monotonic seconds), yields (count), preemptors (bit mask of tiers),
# waiting (its tasks blocked in celery_prio.wait on other tasks), held (its messages pushed to the main
# process, waiting in its hand for a slot: RabbitMQ no longer counts them in their queue).
_TIER = struct.Struct("=dqqqq")
# Global: pending yields (since the main process last refilled), tier yielded for (+1; 0 none).
_GLOBAL = struct.Struct("=qq")
# After the tiers: how many times the queues the main process serves changed (a sub-queue found, one gone).
_CHANGES = struct.Struct("=q")
_CHANGES_OFFSET = _GLOBAL.size + _TIER.size * len(TIERS)
_SIZE = _CHANGES_OFFSET + _CHANGES.size


def _mask(tiers: Iterable[Tier]) -> int:
    return sum(1 << t.value for t in tiers)


class SliceBoard:
    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, _SIZE)  # anonymous, MAP_SHARED: inherited across fork
        self._lock = multiprocessing.get_context("fork").Lock()

    # -- layout ------------------------------------------------------------------
    def _tier_offset(self, tier: Tier) -> int:
        return _GLOBAL.size + _TIER.size * tier.value

    def _read_tier(self, tier: Tier) -> tuple[float, int, int]:
        return _TIER.unpack_from(self._mem, self._tier_offset(tier))[:3]

    def _write_tier(self, tier: Tier, asked_at: float, yields: int, preemptors: int) -> None:
        waiting, held = _TIER.unpack_from(self._mem, self._tier_offset(tier))[3:]
        _TIER.pack_into(self._mem, self._tier_offset(tier), asked_at, yields, preemptors, waiting, held)

    def _add_waiting(self, tier: Tier, delta: int) -> None:
        with self._lock:
            fields = list(_TIER.unpack_from(self._mem, self._tier_offset(tier)))
            fields[3] = max(fields[3] + delta, 0)
            _TIER.pack_into(self._mem, self._tier_offset(tier), *fields)

    # -- pool child ----------------------------------------------------------------
    def ask(self, tier: Tier, now: float) -> list[Tier]:
        """A sliced task of ``tier`` is at an element boundary: the tiers that would preempt it now."""
        with self._lock:
            _, yields, preemptors = self._read_tier(tier)
            self._write_tier(tier, now, yields, preemptors)
        return [t for t in TIERS if preemptors >> t.value & 1]

    def claim_yield(self, tier: Tier, for_tier: Tier, waiting: int) -> bool:
        """Yield ``tier``'s slot to ``for_tier``, which has ``waiting`` tasks, unless enough yields are pending."""
        with self._lock:
            pending, _ = _GLOBAL.unpack_from(self._mem, 0)
            asked_at, yields, preemptors = self._read_tier(tier)
            if not preemptors >> for_tier.value & 1 or pending >= waiting:
                return False
            _GLOBAL.pack_into(self._mem, 0, pending + 1, for_tier.value + 1)
            self._write_tier(tier, asked_at, yields + 1, preemptors)
            return True

    def held(self, tier: Tier) -> int:
        """``tier``'s messages the main process holds for a slot (pushed to it: not in the broker's count)."""
        with self._lock:
            return int(_TIER.unpack_from(self._mem, self._tier_offset(tier))[4])

    def queue_changes(self) -> int:
        """How many times the main process's served queues changed: a pool child's list of a tier's sub-queues
        made at another count is made again (a per-call realtime task's shortest-first sub-queue may be new)."""
        with self._lock:
            return int(_CHANGES.unpack_from(self._mem, _CHANGES_OFFSET)[0])

    def enter_wait(self, tier: Tier) -> None:
        """A task of ``tier`` blocks in ``celery_prio.wait`` (priority inheritance): it holds a slot, runs nothing."""
        self._add_waiting(tier, 1)

    def leave_wait(self, tier: Tier) -> None:
        self._add_waiting(tier, -1)

    # -- main process ----------------------------------------------------------------
    def waiting(self) -> dict[Tier, int]:
        """Per tier, its tasks blocked in ``celery_prio.wait`` now (a child killed while waiting leaves one)."""
        with self._lock:
            return {t: _TIER.unpack_from(self._mem, self._tier_offset(t))[3] for t in TIERS}

    def active_tiers(self, since: float) -> list[Tier]:
        """Tiers whose sliced tasks looked at the board at or after ``since``."""
        with self._lock:
            return [t for t in TIERS if self._read_tier(t)[0] >= since]

    def set_held(self, held: Mapping[Tier, int]) -> None:
        """Per tier, the messages the main process holds for a slot now."""
        with self._lock:
            for tier in TIERS:
                fields = list(_TIER.unpack_from(self._mem, self._tier_offset(tier)))
                fields[4] = max(int(held.get(tier, 0)), 0)
                _TIER.pack_into(self._mem, self._tier_offset(tier), *fields)

    def queues_changed(self) -> None:
        """The queues the main process serves changed (``queue_changes``)."""
        with self._lock:
            _CHANGES.pack_into(self._mem, _CHANGES_OFFSET, _CHANGES.unpack_from(self._mem, _CHANGES_OFFSET)[0] + 1)

    def set_preemptors(self, preemptors: Mapping[Tier, Iterable[Tier]]) -> None:
        """Per running sliced tier, the tiers it yields to when they have work (absent: none)."""
        with self._lock:
            for tier in TIERS:
                asked_at, yields, _ = self._read_tier(tier)
                self._write_tier(tier, asked_at, yields, _mask(preemptors.get(tier, ())))

    def yielded_for(self) -> Tier | None:
        """The tier the last pending yield was for (the freed slot goes to it first)."""
        return self.pending()[1]

    def pending(self) -> tuple[int, Tier | None]:
        """Yields pending (not yet refilled), and the tier the last was for."""
        if not any(_GLOBAL.unpack_from(self._mem, 0)):
            # None pending (asked once per task a worker runs): read without the lock. A claim sets both fields
            # non-zero, so a read racing it sees both still zero (as if read just before it: the next refill
            # sees it) or one of them set, and then reads both again under the lock.
            return 0, None
        with self._lock:
            pending, for_tier = _GLOBAL.unpack_from(self._mem, 0)
        return pending, (Tier(for_tier - 1) if for_tier else None)

    def refilled(self) -> None:
        """The main process refilled the slots that yields freed: their waiting work is no longer waiting."""
        with self._lock:
            _GLOBAL.pack_into(self._mem, 0, 0, 0)

    def yields(self) -> Mapping[Tier, int]:
        with self._lock:
            return {t: self._read_tier(t)[1] for t in TIERS}


_BOARD: SliceBoard | None = None

#: Per thread of a pool child: whether its running task is already counted as blocked (nested waits count once).
_WAITING = threading.local()


@contextmanager
def blocked_waiting(tier: Tier | None) -> Iterator[None]:
    """The running task of ``tier`` blocks on other tasks' results inside this block: the worker counts its
    slot as waiting (``TierScheduler.blocked``). Nested waits (``celery_prio.wait`` calling ``get``) count once;
    ``tier`` None (not inside a worker task) counts nothing."""
    if tier is None or getattr(_WAITING, "active", False):
        yield
        return
    _WAITING.active = True
    board().enter_wait(tier)
    try:
        yield
    finally:
        _WAITING.active = False
        board().leave_wait(tier)


def board() -> SliceBoard:
    """This process's board (made on first use; ``install()`` makes it before a worker forks)."""
    global _BOARD
    if _BOARD is None:
        _BOARD = SliceBoard()
    return _BOARD
