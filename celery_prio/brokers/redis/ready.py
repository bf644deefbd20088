"""The ready index's safety net: the fleet's housekeeper puts back any list with work that the index misses.

Every celery-prio writer keeps ``<prefix>.ready`` exact in the same call
as its push (``lua/mark_ready.lua``, the transport's ``_put`` and restore),
and a fetch asks only indexed lists (``lua/fetch.lua``). A writer that does
not know the index (a producer still on a release before it, a plain kombu
client publishing into a tier list) would leave its list unseen: this round
looks at every list of the fleet (tier queues, front lanes, registered
sub-queues, each with kombu's priority lists), ``HEAL_BATCH`` lists per run,
so such a message waits at most a round, never forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...headers import PROMOTED_SUFFIX
from ...settings import PrioSettings
from ...tiers import TIERS
from .scripts import HEAL_READY
from .transport import registered_subqueues

if TYPE_CHECKING:
    from kombu.transport.redis import Channel as RedisChannel

#: Seconds between runs (on the housekeeper only), and lists looked at per run: a fleet of 2,000 lists is
#: covered every 4 s for about 500 cheap ``EXISTS`` a second.
HEAL_INTERVAL = 1.0
HEAL_BATCH = 500


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
        missing = int(channel.client.eval(HEAL_READY, 1 + len(batch), self.settings.ready_key, *batch))
        self.healed += missing
        return missing
