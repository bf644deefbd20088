"""How often a pushed queue found empty is reported to the scheduler (``prio_fetch = "consume"``). Pure.

A pushed queue's consumer tells when work comes, so the scheduler need not
hear on every take that it is still empty: each is reported at most every
``IDLE_REPORT_INTERVAL`` while it stays empty, less often where one take
finds many (``IDLE_REPORTS_PER_S``: 500 idle tenants are reported every
2 s, not 500 at a time per task). An idle queue ordered again is lifted
level then (``QueueShares.order``). Queues asked by ``basic_get`` are
reported every time.
"""

from __future__ import annotations

from collections.abc import Container

#: A pushed queue that stays empty is reported to the scheduler (looked at, idle) at most this often.
IDLE_REPORT_INTERVAL = 0.05
#: Idle pushed queues reported a second at most, per take's report (a tier of many is reported less often).
IDLE_REPORTS_PER_S = 250


def report_interval(queues: tuple[str, ...]) -> float:
    """How often each of ``queues``, found empty together, is reported."""
    return max(IDLE_REPORT_INTERVAL, len(queues) / IDLE_REPORTS_PER_S)


class IdleReports:
    """When each pushed queue was last reported empty."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}
        # The last ``queues`` asked about, when all were pushed, and when the first of them is due again: a busy
        # drain's every take finds the same empty queues beside the one it takes from (its tier's other queues),
        # and until one is due the answer is none, with no look at each.
        self._last: tuple[tuple[str, ...], float] | None = None

    def due(self, queues: tuple[str, ...], pushed: Container[str], now: float) -> tuple[str, ...]:
        """Of ``queues`` (found empty), those to report now; the pushed ones among them are noted as reported."""
        if not queues:
            return queues
        last = self._last
        if last is not None and now < last[1] and last[0] == queues:
            return ()
        reported, every = self._at, report_interval(queues)
        due = []
        all_pushed = True
        earliest = now  # the oldest report among them once this one is noted: when the first is due again
        for name in queues:
            if name in pushed:
                at = reported.get(name, float("-inf"))
                if now - at < every:
                    earliest = min(earliest, at)
                    continue
                reported[name] = now
            else:
                all_pushed = False  # asked by basic_get: reported every time
            due.append(name)
        self._last = (queues, earliest + every) if all_pushed else None
        return tuple(due)

    def next_due(self, queues: tuple[str, ...], now: float) -> float:
        """When the first of ``queues`` (all pushed, just passed to :meth:`due`) is due again: what that call
        worked out, when it was about the same queues."""
        last = self._last
        if last is not None and last[0] == queues:
            return last[1]
        reported = self._at
        return min([reported.get(name, now) for name in queues], default=now) + report_interval(queues)

    def busy(self, name: str) -> None:
        """``name`` had work (or is no longer pushed): reported at once the next time it is found empty."""
        if self._at.pop(name, None) is not None:
            self._last = None


__all__ = ["IDLE_REPORTS_PER_S", "IDLE_REPORT_INTERVAL", "IdleReports", "report_interval"]
