"""Redis's ready index, seen from Python: which lists it covers, depths read through it, and its safety nets.

Every celery-prio writer keeps ``<prefix>.ready-index`` exact in the same call
as its push (``lua/mark_ready.lua``, the transport's ``_put`` and restore),
and a fetch asks only indexed lists (``lua/fetch.lua``). A writer that does
not know the index (a producer still on a release before it, a plain kombu
client publishing into a tier list) would leave its list unseen: this round
looks at every list of the fleet (tier queues, front lanes, registered
sub-queues, each with kombu's priority lists), ``HEAL_BATCH`` lists per run,
so such a message waits at most a round, never forever. A worker whose
indexed fetch found nothing also asks its tier lists and lanes (where such
a writer pushes; a sub-queue's list is left to this round), at most every
``FULL_ASK_INTERVAL`` (``RedisFetchSource.take``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...headers import PROMOTED_SUFFIX
from ...settings import PrioSettings
from ...tiers import TIERS
from .scripts import HEAL_READY
from .transport import pinned_list, registered_subqueues

if TYPE_CHECKING:
    from kombu.transport.redis import Channel as RedisChannel

#: Seconds between a worker's full asks (its tier lists and lanes, the ready index mended): only when the index
#: found nothing, so a busy worker never makes one.
FULL_ASK_INTERVAL = 1.0

#: Seconds between runs (on the housekeeper only), and lists looked at per run: a fleet of 2,000 lists is
#: covered every 4 s for about 500 cheap ``EXISTS`` a second.
HEAL_INTERVAL = 1.0
HEAL_BATCH = 500
#: A worker reads its copy of the index again when it is this old (``ReadyCopy.expire_if_older``).
COPY_REFRESH = 2.0
#: The version an expired copy claims (an index's is a number).
EXPIRED = "expired"


class ReadyHeal:
    def __init__(self, settings: PrioSettings) -> None:
        self.settings = settings
        self._cursor = 0
        self.healed = 0  # lists found missing from the index (each one a writer that does not know it)

    def lists(self, channel: RedisChannel) -> list[str]:
        settings = self.settings
        queues = [settings.queue_name(t) + suffix for t in TIERS for suffix in ("", PROMOTED_SUFFIX)]
        queues += registered_subqueues(channel.client, settings.subqueue_registry)
        return [channel._q_for_pri(q, pri) for q in queues for pri in channel.priority_steps]

    def run(self, channel: RedisChannel) -> int:
        """One batch of the fleet's lists looked at; how many had work and were missing from the index."""
        names = self.lists(channel)
        if self._cursor >= len(names):
            self._cursor = 0
        batch = names[self._cursor : self._cursor + HEAL_BATCH]
        self._cursor += HEAL_BATCH
        missing = int(channel.client.eval(HEAL_READY, 1 + len(batch), self.settings.ready_key, *batch, time.time()))
        self.healed += missing
        return missing


class ReadyCopy:
    """A worker's copy of the ready index (every member, lingering ones too: one pushed to again does not move
    the version), read again when a fetch reply shows its version moved (a sub-queue's list joined it): the
    fetch script is passed only the sub-queue lists the copy holds, the tier
    lists and lanes (``transport.pinned_list``), and those the index does not cover, so what one fetch sends
    does not grow with the sub-queues a worker serves. A stale copy only ever misses sub-queue lists that joined
    since; the fetch that shows it is asked again at once (``RedisFetchSource.take``)."""

    def __init__(self, settings: PrioSettings, sep: str) -> None:
        self.settings, self.sep = settings, sep
        self.members: frozenset[str] | None = None  # None: not read yet (every list is passed)
        self.queues: frozenset[str] = frozenset()  # the queues of ``members``' lists (a queue with work, by it)
        self.version = ""
        self.read_at = float("-inf")  # monotonic
        self._kinds: dict[str, str] = {}  # list -> 'uncovered', 'pinned' or 'sub-queue'

    def may_have_work(self, queue: str) -> bool:
        """Whether a fetch passes any of ``queue``'s lists (one in the copy, or one always passed): those it
        does not are empty by the index, and are neither ordered nor asked (``RedisFetchSource.take``)."""
        return self.members is None or queue in self.queues or self.passed(queue)

    def select(self, keys: list[str]) -> list[str]:
        members = self.members
        return keys if members is None else [k for k in keys if k in members or self.passed(k)]

    def moved(self, client: Any, version: object, members: Any = None) -> None:
        """A fetch reply saw the index at ``version`` (and, when it refused a stale copy, its ``members``)."""
        text = version.decode() if isinstance(version, bytes) else str(version or "")
        if text != self.version or self.members is None:
            found = client.zrange(self.settings.ready_key, 0, -1) if members is None else members
            self.members = frozenset(m.decode() if isinstance(m, bytes) else str(m) for m in found)
            self.queues = frozenset(m.split(self.sep, 1)[0] for m in self.members)
            self.version, self.read_at = text, time.monotonic()

    def expire_if_older(self, seconds: float) -> None:
        """Read the copy again at the next fetch (its reply carries the index) when it is ``seconds`` old. Lists
        leave the index without moving its version (only joining moves it), so a copy read when 500 tenants
        held work passes all 500 to every fetch until a list joins; read again, it holds only those with work."""
        if self.members is not None and time.monotonic() - self.read_at > seconds:
            self.version = EXPIRED  # no index has this version: the script refuses the copy and sends the index

    def mask(self, keys: list[str], full: bool) -> str:
        """The fetch script's mask: '1' for a list the index covers (asked only while indexed), '0' for one
        always asked (the app's own queues, legacy queues), '2' for a covered list asked anyway (mended)."""
        return "".join(("2" if full else "1") if self.covers(key) else "0" for key in keys)

    def covers(self, key: str) -> bool:
        return self._kind(key) != "uncovered"

    def passed(self, key: str) -> bool:
        """Passed to every fetch whatever the copy holds: a list the index does not cover, or a tier list or
        front lane (one joining does not move the index's version, ``lua/mark_ready.lua``)."""
        return self._kind(key) != "sub-queue"

    def _kind(self, key: str) -> str:
        kind = self._kinds.get(key)
        if kind is None:
            queue = key.split(self.sep, 1)[0]  # kombu's priority lists: "<queue><sep><priority>"
            if not self.settings.is_indexed(queue):
                kind = "uncovered"
            else:
                kind = "pinned" if pinned_list(self.settings.ready_key, key) else "sub-queue"
            self._kinds[key] = kind
        return kind


def indexed_depths(client: Any, settings: PrioSettings, names: list[str]) -> list[int]:
    """``LLEN`` of each, but only of lists the ready index holds (or does not cover): a busy worker's report
    asks its dozens of empty lists nothing."""
    covered = [name for name in names if settings.is_indexed(name)]
    ready = dict(zip(covered, client.zmscore(settings.ready_key, covered), strict=True)) if covered else {}
    asked = [name for name in names if ready.get(name, 0) == 0]  # score 0 (or not covered); None, a time: empty
    pipe = client.pipeline(transaction=False)
    for name in asked:
        pipe.llen(name)
    depth = dict(zip(asked, (int(n) for n in pipe.execute()), strict=True))
    return [depth.get(name, 0) for name in names]
