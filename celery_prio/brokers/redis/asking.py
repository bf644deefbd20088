"""Which of a Redis worker's lists a fetch asks, in asking order, and which it leaves out as empty.

A worker may serve thousands of lists (each tier, each task's shortest-first
queue, each tenant's sub-queue, each with kombu's priority lists), most of
them empty. The ready index (``ready.py``) says which hold work: a fetch
orders and asks only the queues with a list in this worker's copy of it, and
those the index does not cover or always passes (``ReadyCopy.passed``), so its
cost here and in the script does not grow with the lists served. The queues
left out are reported empty now and then (their shortest-first look times
move; their share is lifted when next ordered, ``QueueShares.order``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ...policy.served import Candidate, ServedQueues
from ...tiers import Tier
from ..shared import as_text
from .ready import ReadyCopy

if TYPE_CHECKING:
    from redis import Redis

#: Queues whose lists ``keys_for`` remembers (queue names come from the registry, anyone's input: bounded).
KEYS_REMEMBERED = 10_000
#: Seconds between reports of a tier's queues a fetch left out as empty by the ready index (``due_unasked``),
#: and queues reported a second at most per tier (500 idle tenants: every 2 s).
UNASKED_REPORT_INTERVAL = 0.05
UNASKED_REPORTS_PER_S = 250


class ListPlan:
    def __init__(
        self, served: ServedQueues, ready: ReadyCopy, list_of: Callable[[str, int], str], steps: list[int]
    ) -> None:
        self.served, self.ready = served, ready
        self.list_of, self.steps = list_of, steps  # kombu's ``_q_for_pri`` and ``priority_steps``
        self._keys: dict[str, list[str]] = {}  # queue -> its lists (``keys_for``)
        self._unasked_reported: dict[Tier, float] = {}  # when each tier's queues empty by the index were reported

    def keys_for(self, queue: str) -> list[str]:
        keys = self._keys.get(queue)
        if keys is None:  # a busy worker asks it for every queue it passes: worked out once per queue
            keys = [self.list_of(queue, pri) for pri in self.steps]
            if len(self._keys) < KEYS_REMEMBERED:
                self._keys[queue] = keys
        return keys

    def lists(self, tiers: list[Tier], every: bool = False) -> list[tuple[str, Candidate]]:
        """The lists of ``tiers``' queues in asking order, with their queue: those the copy of the index may
        show with work (no copy read yet: all of them); ``every``: those a writer that does not know the index
        pushes to (tier lists, front lanes, lists it does not cover), whatever the copy holds. A sub-queue's
        list is celery-prio's own: only its publishers write there, and they keep the index; the housekeeper's
        round still looks at each (``ReadyHeal``), so a full ask costs the same whatever the tenants served."""
        indexed = not every and self.ready.members is not None
        keep, select = (self.ready.may_have_work, self.ready.select) if indexed else (None, None)
        if every:
            passed = self.ready.passed
            select = lambda keys: [k for k in keys if passed(k)]  # noqa: E731
        out: list[tuple[str, Candidate]] = []
        for tier in tiers:
            for candidate in self.served.candidates(tier, keep):
                keys = self.keys_for(candidate.name)
                out.extend((key, candidate) for key in (keys if select is None else select(keys)))
        return out

    def due_unasked(self, tiers: list[Tier]) -> tuple[str, ...]:
        """The served queues of ``tiers`` a fetch left out as empty by the index, each tier's every
        ``UNASKED_REPORT_INTERVAL`` (longer for a tier of many: ``UNASKED_REPORTS_PER_S`` in all)."""
        if self.ready.members is None:
            return ()  # no copy yet: nothing was left out
        now, out = time.monotonic(), []
        may_have_work = self.ready.may_have_work
        for tier in tiers:
            names = self.served.by_tier[tier]
            every = max(UNASKED_REPORT_INTERVAL, len(names) / UNASKED_REPORTS_PER_S)
            if now - self._unasked_reported.get(tier, float("-inf")) >= every:
                self._unasked_reported[tier] = now
                out += [n for n in names if not may_have_work(n)]
        return tuple(out)

    def served_lists(self, tiers: list[Tier]) -> Iterator[str]:
        """Every list of ``tiers``' queues, front lanes first, in no particular order."""
        for tier in tiers:
            lane = self.served.promoted.get(tier)
            for name in [lane, *self.served.by_tier[tier]] if lane else self.served.by_tier[tier]:
                yield from self.keys_for(name)

    def anything_waiting(self, client: Redis, tiers: list[Tier]) -> bool:
        """Whether a list of ``tiers`` holds work (the doorbell's net at each timeout), in one round trip:
        ``EXISTS`` over the lists the index does not cover or always passes, and the index itself for the
        others (it holds the lists with work, a few while idle), not a key per list served. A list written
        by a client that does not know the index joins it at the housekeeper's next round (``ReadyHeal``)."""
        always, indexed = [], set()
        for key in self.served_lists(tiers):
            (always.append if self.ready.passed(key) else indexed.add)(key)
        pipe = client.pipeline(transaction=False)
        pipe.zrange(self.ready.settings.ready_key, 0, 0, byscore=True)  # score 0: pushed to since found empty
        if always:
            pipe.exists(*always)
        members, *exists = pipe.execute()
        return bool(exists and exists[0]) or any(as_text(m) in indexed for m in members)
