"""Boost on Redis: find a queued task by id and move it into the front lane of a higher tier, atomically.

A task that someone important now waits on leaves its list for
``<tier>.promoted`` (served before the tier's own queue) in one script that
removes it only if it is still there and adds the rewritten copy in the same
step: it is never lost and never in two lists, so it runs once. Finding it is
a read-only scan inside Redis, newest end first, in looks of
:data:`BOOST_SCAN_BUDGET` elements so that Redis is never held for long
(a task at the oldest end of a 1,000,000-message backlog: about 100 looks).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ...headers import BOOSTED_HEADER
from ...policy.aging import readdress
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ..base import Boost
from ..publishing import Booster, Publisher
from ..shared import boost_lane, tier_full, tier_queues
from .continuations import RedisContinuations
from .scripts import BOOST_FIND, BOOST_HELD, BOOST_MOVE, BOOST_SCAN_BUDGET

if TYPE_CHECKING:
    from redis import Redis

#: Elements a look starts before where the previous one ended: a boost elsewhere
#: that removed an element ahead of the cursor shifts the rest one place left.
SCAN_OVERLAP = 100
#: Looks again when the task left its list between the find and the move.
MOVE_TRIES = 3
#: Entries of kombu's unacked hash read per call while looking whether a worker holds the task.
HELD_PAGE = 500


class RedisBooster(Booster):
    def __init__(self, publisher: Publisher, connections: RedisContinuations) -> None:
        super().__init__(publisher)
        self.connections = connections  # one connection per process, and the sub-queue listing
        self._scripts: dict[str, Any] = {}

    def _script(self, client: Redis, source: str) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = client.register_script(source)
        return script

    def lift(self, task_id: str, tier: Tier) -> Boost | None:
        """Lift ``task_id`` into ``tier``; None when it is in none of this app's queues and no worker holds it."""
        settings = self.settings
        lane = boost_lane(settings, tier)
        subqueues = self.connections.subqueues()
        lower = [q for t in TIERS if t > tier for q in tier_queues(settings, t, subqueues)]
        # The lane again at the end: a concurrent boost may have moved it there while this one looked below.
        higher = [*(q for t in TIERS if t <= tier for q in tier_queues(settings, t, subqueues) if q != lane), lane]
        unacked = self.connections.connection().default_channel.unacked_key  # kombu's: workers' fetched messages
        return self.connections.guarded(
            lambda client: self._lift(client, settings, task_id, tier, lane, lower, higher, unacked)
        )

    def _lift(
        self,
        client: Redis,
        settings: PrioSettings,
        task_id: str,
        tier: Tier,
        lane: str,
        lower: list[str],
        higher: list[str],
        unacked: str,
    ) -> Boost | None:
        if self.find(client, task_id, [lane]) is not None:  # boosted before: the cheap look first
            return Boost("already", task_id, tier, queue=lane)
        for _ in range(MOVE_TRIES):
            hit = self.find(client, task_id, lower)
            if hit is None:
                break
            queue, raw = hit
            from_tier = settings.tier_for_queue(queue)
            message = json.loads(raw)  # the script parsed it already: it is a JSON object with headers
            rewritten = json.dumps(readdress(message, from_tier, lane, BOOSTED_HEADER))
            move = self._script(client, BOOST_MOVE)
            cap, tier_list = settings.max_length[tier], settings.queue_name(tier)
            moved = move(
                keys=[
                    *(queue, lane, settings.stats_key, settings.bell_key(tier), tier_list),
                    *(settings.subqueue_registry, settings.ready_key),
                ],
                args=[raw, rewritten, from_tier.label, -1 if cap is None else cap, tier_list + "."],
                client=client,
            )
            if moved == -1:
                return Boost("refused", task_id, tier, from_tier, queue, detail=tier_full(tier, cap))
            if moved:
                return Boost("boosted", task_id, tier, from_tier, queue)
            # Gone between the look and the move: a worker took it, aging or another boost moved it. Look again.
        hit = self.find(client, task_id, higher)
        if hit is not None:
            return Boost("already", task_id, tier, settings.tier_for_queue(hit[0]), hit[0])
        if self.held(client, task_id, unacked):
            return Boost("running", task_id, tier, detail="fetched by a worker and not acked yet")
        return None

    def held(self, client: Redis, task_id: str, unacked: str) -> bool:
        """Whether a worker holds the task (kombu's unacked hash), read a page per call."""
        script, cursor = self._script(client, BOOST_HELD), "0"
        while True:
            found, cursor = script(keys=[unacked], args=[task_id, cursor, HELD_PAGE], client=client)
            if int(found):
                return True
            if cursor in (b"0", "0", 0):
                return False

    def find(self, client: Redis, task_id: str, queues: list[str]) -> tuple[str, bytes] | None:
        """``(queue, element)`` of the task among ``queues``, or None; in looks of bounded length."""
        if not queues:
            return None
        script = self._script(client, BOOST_FIND)
        start, offset = 1, 0
        while True:
            hit = script(keys=queues, args=[task_id, BOOST_SCAN_BUDGET, start, offset], client=client)
            if hit is None:
                return None
            if int(hit[0]) == 0:  # the look's budget ended: go on from there
                ended_in, ended_at = int(hit[1]), int(hit[2])
                progress = ended_at - offset if ended_in == start else ended_at
                # Overlap at most half of what the look read, so looks of a few big messages still move on.
                start, offset = ended_in, max(0, ended_at - min(SCAN_OVERLAP, progress // 2))
                continue
            return queues[int(hit[0]) - 1], hit[2]
