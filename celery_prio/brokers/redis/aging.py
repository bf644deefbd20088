"""The aging pass on Redis: due messages of a tier move to the upper tier's front lane, atomically.

Run by the fleet's housekeeper (``housekeeping.py``) and by operators' tools
(``RedisAdapter.promote_aged``), each on its own client. A pass looks only at
the oldest end of a list and moves due messages with a compare-and-move
script: concurrent passes never move one message twice, a pass killed midway
loses nothing, and its cost follows the number promoted, not the queue length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...headers import PROMOTED_SUFFIX
from ...policy.aging import plan_promotions
from ...settings import PrioSettings
from ...tiers import Tier
from .scripts import DEAD_HEAD, PROMOTE, SCRIPT_BYTES, STAMP

if TYPE_CHECKING:
    from redis import Redis

#: How many of the oldest elements one aging look reads (and may stamp).
AGING_WINDOW = 100

#: Garbage one aging pass moves aside at most: a pass stays short, the next goes on.
MAX_DEAD_PER_PASS = 1000


class RedisAging:
    def __init__(self, client: Redis) -> None:
        self.client = client
        self._promote = client.register_script(PROMOTE)
        self._stamp = client.register_script(STAMP)
        self._dead_head = client.register_script(DEAD_HEAD)
        # Per source list: how deep the stamping look has reached beyond the head window.
        self._stamp_cursor: dict[str, int] = {}
        self._aging_window: dict[str, int] = {}  # per list: elements an aging look reads (bounded by bytes)

    def promote_aged(
        self, settings: PrioSettings, tier: Tier, now: float, batch: int = AGING_WINDOW, source: str | None = None
    ) -> int:
        """Move due messages of ``tier`` (its queue, or ``source``: one of its sub-queues) into the upper
        tier's front lane; returns how many moved. A sub-queue's messages go to the front lane too: they
        have waited long enough for their tenant's turn in the upper tier not to matter."""
        threshold = settings.aging[tier]
        if threshold is None or tier is Tier.REALTIME:
            return 0
        source = source or settings.queue_name(tier)
        upper = settings.queue_name(tier.promoted())
        promoted = upper + PROMOTED_SUFFIX
        cap = settings.max_length[tier.promoted()]
        moved = dead = 0
        batch = self._window_for(source, batch)
        for _ in range(10_000):  # bounded: a pass ends even if producers outpace it
            oldest_first = self.client.lrange(source, -batch, -1)[::-1]
            self._learn_window(source, oldest_first, AGING_WINDOW)
            plan = plan_promotions(oldest_first, tier, promoted, threshold, now)
            if plan.dead_heads:
                args: list[Any] = [tier.label, now]
                for raw, reason in plan.dead_heads:
                    args += [raw, reason]
                done = int(self._dead_head(keys=[source, settings.dead_letter_queue, settings.stats_key], args=args))
                dead += done
                if done < len(plan.dead_heads) or dead >= MAX_DEAD_PER_PASS:
                    break  # someone else moved them, or enough garbage for one pass: the next pass goes on
                continue
            if plan.stamps:
                self._stamp_all(source, plan.stamps)
            if not plan.originals:
                if not plan.stamps and len(oldest_first) == batch and moved == 0:
                    # Only on passes that promoted nothing: a promoting pass is busy enough.
                    self._stamp_deeper(source, tier, now, batch)
                break
            n = len(plan.originals)
            done = int(
                self._promote(
                    keys=[
                        source,
                        promoted,
                        upper,
                        settings.stats_key,
                        settings.bell_key(tier.promoted()),
                        settings.ready_key,
                    ],
                    args=[-1 if cap is None else cap, tier.label, n, *plan.originals, *plan.rewritten],
                )
            )
            moved += done
            if done < n or n < len(oldest_first) or len(oldest_first) < batch:
                break  # another ager got there first, the upper tier is full, or the due run ended
        return moved

    def _window_for(self, source: str, most: int) -> int:
        """Elements one aging look at ``source`` reads: ``most``, fewer where its messages are big, so a
        look (and the promote call carrying originals and copies) stays near ``SCRIPT_BYTES``. The first
        look at a list is sized by its oldest element."""
        window = self._aging_window.get(source)
        if window is None:
            head = self.client.lindex(source, -1)
            window = _fitting(len(head) if head else 1, most)
        return min(window, most)

    def _learn_window(self, source: str, elements: list[bytes], most: int) -> None:
        if elements:
            self._aging_window[source] = _fitting(sum(len(e) for e in elements) / len(elements), most)

    def _stamp_all(self, source: str, stamps: list[tuple[int, bytes, str]]) -> None:
        args: list[Any] = []
        for index, original, stamped in stamps:
            args += [-1 - index, original, stamped]
        self._stamp(keys=[source], args=args)

    def _stamp_deeper(self, source: str, tier: Tier, now: float, batch: int) -> None:
        """Stamp one more window behind the head, a window per pass, so a deep unstamped backlog starts aging."""
        offset = self._stamp_cursor.get(source, batch)
        window = self.client.lrange(source, -(offset + batch), -(offset + 1))[::-1]
        plan = plan_promotions(window, tier, "", float("inf"), now, offset=offset)
        if plan.stamps:
            self._stamp_all(source, plan.stamps)
        self._stamp_cursor[source] = offset + batch if len(window) == batch else batch


def _fitting(element_bytes: float, most: int) -> int:
    """How many elements of about ``element_bytes`` fit in ``SCRIPT_BYTES`` (1 to ``most``)."""
    return max(1, min(most, int(SCRIPT_BYTES // max(element_bytes, 1.0))))


__all__ = ["AGING_WINDOW", "MAX_DEAD_PER_PASS", "RedisAging"]
