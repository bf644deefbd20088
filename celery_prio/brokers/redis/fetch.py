"""A Redis worker's fetch source: one script call per fetch over every served list, in order."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ...policy.served import Candidate, ServedQueues
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import decode_problem, decode_redis_element, split_unacked_entry
from ..base import MAX_ANNOUNCED_TASKS, BoostRecord, BrokerFetchSource, BrokerFigures, Job, Take
from ..shared import as_text
from . import figures
from .asking import ListPlan
from .doorbell import Doorbell
from .housekeeping import SWEEP_BATCH, RedisHousekeeping
from .liveness import HOUSEKEEPER_LEASE, PROCESS_HEARTBEAT
from .ready import COPY_REFRESH, FULL_ASK_INTERVAL, ReadyCopy, indexed_depths
from .scripts import BELL_MAX, DEAD_LETTER, FETCH, HEARTBEAT, SCRIPT_BYTES
from .server import check_server_version
from .transport import UNSETTLED, registered_subqueues

if TYPE_CHECKING:
    from celery import Celery
    from kombu.asynchronous import Hub
    from kombu.message import Message
    from kombu.transport.redis import Channel as RedisChannel
    from redis import Redis

logger = logging.getLogger(__name__)

#: A beat writes the tiers a worker serves at least every this many beats (and whenever they change).
SERVING_REWRITE = 30


class RedisFetchSource(BrokerFetchSource):
    """The worker's Redis side: one round trip per fetch, over every served list in order.

    One script takes the oldest message of the first non-empty list and
    records it unacked, atomically: an empty tier costs nothing extra, and the
    message is in kombu's unacked hash (so a dead worker's message is
    restored) from the instant it leaves its list. Elements that are not
    kombu messages are moved to the dead letters by the same script, with
    their reason; they never reach Celery.
    """

    def __init__(
        self, app: Celery, channel: RedisChannel, served: ServedQueues, settings: PrioSettings, worker_name: str
    ) -> None:
        from kombu.serialization import prepare_accept_content
        from kombu.transport import virtual

        super().__init__(served, settings)
        self.channel = channel
        self.worker_name = worker_name
        self.accept = prepare_accept_content(app.conf.accept_content)
        self._script = channel.client.register_script(FETCH)
        self._beat = channel.client.register_script(HEARTBEAT)
        self._dead_letter = channel.client.register_script(DEAD_LETTER)
        self._local_append = virtual.QoS.append  # kombu's in-process bookkeeping only
        self.chores: RedisHousekeeping | None = None  # its fleet jobs, once the worker asks for them
        self._registry: list[str] | None = None  # sub-queues, as of ``_registry_version``
        self._registry_version: object = None
        self._served_version: object = None  # the registry version whose sub-queues this worker serves
        self.doorbell: Doorbell | None = None  # the idle wait, once the worker's event loop is known
        # (``served.version``, tiers whose every list a fetch asked and found empty at that version)
        self._found_empty: tuple[int, frozenset[Tier]] = (-1, frozenset())
        self._full_at = float("-inf")  # the last full ask (``take``)
        self._ready = ReadyCopy(self.settings, channel.sep)  # this worker's copy of the ready index
        self.plan = ListPlan(served, self._ready, channel._q_for_pri, channel.priority_steps)

    def attach_loop(self, hub: Hub) -> None:
        self.hub = hub
        self.doorbell = Doorbell(
            lambda: self.channel._create_client(asynchronous=False),
            self.settings,
            hub,
            on_ring=lambda: self.on_arrival(),
            free_slots=lambda: self.free_slots(),
            anything_waiting=self.plan.anything_waiting,
        )

    def wait_for_work(self, order: list[Tier]) -> bool:
        """Idle: block on the doorbells of ``order``'s tiers (``doorbell.py``) instead of polling."""
        return self.doorbell is not None and self.doorbell.wait(order)

    def stop(self) -> None:
        self._stopped = True  # the next beat gives the housekeeper lease up: another worker takes the jobs
        if self.doorbell is not None:
            self.doorbell.close()

    #: One fetch script call asks every served list: serving more queues costs no round trip.
    asks_all_queues_in_one_call = True

    def keys_for(self, queue: str) -> list[str]:
        return self.plan.keys_for(queue)

    def take(self, order: list[Tier]) -> Take:
        # Tiers whose bells this worker waits on are known to be empty: not asked (a busy worker whose
        # reserved slot is free would otherwise ask realtime's every list after each task it starts).
        # Only while the served lists are those the last full ask found empty: a sub-queue discovered
        # since (from that very reply, say) was never asked, and its first message rang no bell we wait on.
        version = self.served.version
        quiet: frozenset[Tier] = frozenset()
        if self.doorbell is not None and version == self._found_empty[0]:
            quiet = self.doorbell.quiet_tiers() & self._found_empty[1]
        if quiet.issuperset(order):
            return Take(empty=tuple(order))
        tiers = [t for t in order if t not in quiet]
        # Only the lists the ready index holds (this worker's copy of it) are ordered and passed, and those it
        # does not cover: a fetch's cost, here and in the script, does not grow with the lists served, most of
        # them empty. The queues left out are empty by the index; they are reported so now and then.
        hit, asked = self._fetch_ready(tiers)
        full = False
        if hit is None and time.monotonic() - self._full_at >= FULL_ASK_INTERVAL:
            # The index found nothing: once a second at most, the tier lists and lanes are asked whatever the
            # index holds (and it is mended), so a writer that does not know the index (an older producer, a
            # plain kombu client) is seen here too.
            self._full_at = time.monotonic()
            self.broker_calls += 1
            asked, full = self.plan.lists(tiers, every=True), True
            hit = self.fetch([k for k, _ in asked], [c.tier for _, c in asked], full=True)
        unasked = () if full else self.plan.due_unasked(tiers)
        if hit is None:
            if not quiet:  # every list of these tiers asked and found empty, as served now
                seen = self._found_empty[1] if self._found_empty[0] == version else frozenset()
                self._found_empty = (version, seen | frozenset(order))
            owners = dict.fromkeys(c.name for _, c in asked)
            return Take(empty=tuple(order), empty_queues=(*owners, *unasked))
        position, message = hit
        if message is None:
            return Take(dead_lettered=1)
        candidate = asked[position][1]
        passed = dict.fromkeys(c.name for _, c in asked[:position] if c.name != candidate.name)
        return Take(candidate.tier, message, tuple(order[: order.index(candidate.tier)]), 0, candidate.name,
                    (*passed, *unasked))  # fmt: skip

    def _fetch_ready(self, tiers: list[Tier]) -> tuple[tuple[int, Message | None] | None, list[tuple[str, Candidate]]]:
        """The fetch over the lists of ``tiers`` that the ready index may hold; asked again at once when the
        reply shows the index gained a list since this worker's copy (a first message in an empty list): the
        script takes nothing from a stale copy's lists, so a list that joined since is never passed over."""
        self._ready.expire_if_older(COPY_REFRESH)
        for attempt in range(3):
            seen = self._ready.members
            asked = self.plan.lists(tiers)
            checked = self._ready.version if seen is not None and attempt < 2 else ""
            self.broker_calls += 1
            hit = self.fetch([k for k, _ in asked], [c.tier for _, c in asked], checked=checked)
            if hit is not None or self._ready.members is seen:
                break
        return hit, asked

    #: A safety net only: every fetch already returns the registry's version (see ``_registry_moved``).
    discovery_interval = 5.0

    def discover_subqueues(self) -> list[str] | None:
        registry = self.settings.subqueue_registry
        try:
            version = self.channel.client.get(self.settings.subqueue_registry_version)
            if version == self._registry_version and self._registry is not None:
                return self._registry
            members = registered_subqueues(self.channel.client, registry)
        except self.channel.connection_errors as exc:
            self.discovery_problem = f"cannot read the sub-queue registry {registry}: {exc!r}"
            return None
        self.discovery_problem = None
        self._registry_version, self._registry = version, members
        return self._registry

    def _registry_moved(self, version: object, found: bool) -> None:
        """A fetch saw the registry at ``version``: a new sub-queue is served from the next fetch on.

        When this fetch found nothing, the loop is woken to ask again at
        once, so a new sub-queue's first message waits for no poll interval.
        """
        if version == self._served_version:
            return
        names = self.discover_subqueues()
        if names is None:
            return
        self._served_version = version
        if names != self.served.discovered:
            self.served.set_discovered(names)
            if not found:
                self.on_arrival()

    def fetch(
        self, keys: list[str], tiers: list[Tier], full: bool = False, checked: str = ""
    ) -> tuple[int, Message | None] | None:
        """``(index into keys, kombu Message)`` for the first non-empty key, or None when all are empty.

        ``(index, None)`` means elements were dead-lettered and nothing is
        delivered yet: ask again. ``tiers[i]`` is the tier of ``keys[i]``.
        """
        if UNSETTLED:  # an ack refused a moment ago (a failover, no reconnect since): settled first
            self.settle_unsettled()
        hit = self._fetch(keys, tiers, full=full, checked=checked)
        if hit is None:
            return None
        position, messages = hit
        return position, (messages[0] if messages else None)

    def take_more(self, queue: str, tier: Tier, count: int, task: str, max_bytes: int = 0) -> list[Message]:
        """Up to ``count`` more messages of ``task`` from ``queue``, oldest first (a batch): one call, more only
        where a call stopped at its ``SCRIPT_BYTES`` and ``max_bytes`` leaves room."""
        out: list[Message] = []
        taken_bytes = 0
        while len(out) < count:
            self.broker_calls += 1
            hit = self._fetch(self.keys_for(queue)[:1], [tier], count=count - len(out), task=task, bells=False)
            messages = [] if hit is None else hit[1]
            out += messages
            call_bytes = sum(len(m.prio_raw) for m in messages)
            taken_bytes += call_bytes
            if not messages or call_bytes < SCRIPT_BYTES // 2 or (max_bytes and taken_bytes >= max_bytes):
                break  # the list ran out, or the next one is another task's: nothing more to take now
        return out

    def _fetch(self, keys: list[str], tiers: list[Tier], count: int = 1, task: str = "", bells: bool = True,
               full: bool = False, checked: str = "") -> tuple[int, list[Message]] | None:  # fmt: skip
        """``(index into keys, the kombu Messages taken from it)``; dead-lettered ones are left out (``(-1, [])``
        when the script moved only malformed elements aside); None when every key was empty."""
        channel = self.channel
        reply = self._script(
            keys=[
                *keys,
                channel.unacked_key,
                channel.unacked_index_key,
                self.settings.dead_letter_queue,
                self.settings.stats_key,
                self.settings.owners_key,
                self.settings.subqueue_registry_version,
                self.settings.ready_key,
                # Silenced when all is empty (a batch's top-up leaves them: it asks one queue only).
                *((self.settings.bell_key(t) for t in dict.fromkeys(tiers)) if bells else ()),
            ],
            args=[time.time(), count, task, self.worker_name, self._ready.mask(keys, full), checked]
            + [t.label for t in tiers],
            client=channel.client,
        )
        position, version = int(reply[0]) - 1, reply[1]
        self._ready.moved(self.channel.client, reply[2], reply[3] if position == -3 else None)
        self._registry_moved(version or None, found=position >= -1)  # -2: all empty, -3: nothing taken
        if position in (-3, -2):  # -3: ``checked`` is older than the index, nothing taken (the copy was re-read)
            return None
        if position < 0:
            logger.error("celery-prio: moved %s malformed element(s) to %s", reply[3], self.settings.dead_letter_queue)
            return -1, []
        messages = []
        for raw, tag in zip(reply[3::2], reply[4::2], strict=True):
            message = self._message(raw, as_text(tag), tiers[position], keys[position])
            if message is not None:
                messages.append(message)
        return position, messages

    def _message(self, raw: bytes, tag: str, tier: Tier, queue: str) -> Message | None:
        """kombu's Message for an element the script took; one Python cannot read goes to the dead letters."""
        channel = self.channel
        payload, problem = decode_redis_element(raw)
        message = None
        if problem is None:
            try:
                message = channel.Message(payload, channel=channel)
            except Exception as exc:  # e.g. a body that is not valid base64
                problem = f"malformed: kombu cannot read it ({exc!r})"
        if message is None:
            self._dead_letter_raw(raw, problem or "malformed", tier, queue, tag)  # the script's tag: cjson read it
            return None
        message.prio_raw = raw  # dead-lettering later keeps the element exactly as it was
        message.prio_queue = queue
        message.accept = self.accept
        self._local_append(channel.qos, message, message.delivery_tag)
        return message

    def _dead_letter_raw(self, raw: bytes, reason: str, tier: Tier, queue: str, tag: str) -> None:
        logger.error("celery-prio: message from %s moved to %s: %s", queue, self.settings.dead_letter_queue, reason)
        channel = self.channel
        self._dead_letter(
            keys=[
                self.settings.dead_letter_queue,
                channel.unacked_key,
                channel.unacked_index_key,
                self.settings.stats_key,
                self.settings.owners_key,
            ],
            args=[raw, reason, tier.label, time.time(), queue, tag],
            client=channel.client,
        )

    def dead_letter(self, message: Message, reason: str, tier: Tier) -> None:
        self._dead_letter_raw(message.prio_raw, reason, tier, getattr(message, "prio_queue", ""), "")

    # -- housekeeping on the worker's loop --------------------------------------
    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        self.chores = RedisHousekeeping(self)
        self.loop_turned_at = time.monotonic()
        return [*self.chores.jobs(dispatched), Job(LOOP_MARK_INTERVAL, self._loop_turned, "the loop turns")]

    def _loop_turned(self) -> None:
        self.loop_turned_at = time.monotonic()

    def recover_own(self, held: set[str]) -> int:
        """Owned by this incarnation but not in its hands: fetched on the connection that died, whose
        restore at close failed (Redis was down). A live owner's messages are never swept, so they would
        stay unacked for good; they go back through kombu's restore now (marked redelivered)."""
        client, mine, returned = self.channel.client, self.worker_name + "|", 0
        self.settle_unsettled()
        for tag, owner in client.hscan_iter(self.settings.owners_key, count=SWEEP_BATCH):
            tag = as_text(tag)
            if as_text(owner).startswith(mine) and tag not in held:
                self.restore_or_dead_letter(tag)
                returned += 1
        if returned:
            logger.warning("celery-prio: returned %d message(s) fetched before the reconnect to their queues", returned)
            self.ring(TIERS, returned)
        return returned

    def ring(self, tiers: list[Tier], n: int) -> None:
        """Ring the doorbells of ``tiers`` for ``n`` messages that went back to their queues outside a script."""
        pipe = self.channel.client.pipeline(transaction=False)
        for tier in tiers:
            bell = self.settings.bell_key(tier)
            pipe.lpush(bell, *["1"] * min(n, BELL_MAX)).ltrim(bell, 0, BELL_MAX - 1)
        pipe.execute()

    def settle_unsettled(self) -> None:
        """Acks and rejects that failed while Redis was unreachable or refused writes: done, so forgotten now,
        not returned."""
        if not UNSETTLED:
            return
        client, settled = self.channel.client, set(UNSETTLED)
        pipe = client.pipeline()
        for tag in settled:
            pipe.hdel(self.channel.unacked_key, tag).zrem(self.channel.unacked_index_key, tag)
            pipe.hdel(self.settings.owners_key, tag)
        pipe.execute()
        UNSETTLED.difference_update(settled)
        logger.info("celery-prio: settled %d message(s) whose ack failed while Redis could not take it", len(settled))

    def fleet_serving(self) -> dict[Tier, int] | None:
        try:
            return figures.serving(self.channel.client, self.settings)
        except self.channel.connection_errors:
            return None

    def announce_tasks(self, names: list[str]) -> None:
        if names:
            self.channel.client.sadd(self.settings.task_directory, *names[:MAX_ANNOUNCED_TASKS])

    def fleet_knows_task(self, name: str) -> bool:
        try:
            return bool(self.channel.client.sismember(self.settings.task_directory, name))
        except self.channel.connection_errors:
            return False

    def join_fleet(self) -> list[BoostRecord]:
        check_server_version(self.channel.client.info("server").get("redis_version"))
        self.heartbeat()  # before the first fetch: the messages it fetches have a live owner from the start
        # Then from a thread, on a connection of its own: a busy event loop (a task under the solo pool,
        # a long housekeeping pass) never makes this live worker look dead.
        beat_client = self.channel._create_client(asynchronous=False)
        PROCESS_HEARTBEAT.attach(lambda: self.heartbeat(beat_client))
        return []

    #: Whether this worker holds the fleet's housekeeper lease (told by every beat; read by the jobs).
    housekeeper = False
    #: When the worker's event loop last ran a job (monotonic; the heartbeat thread reads it), and whether the
    #: source stopped fetching (warm shutdown): either way the fleet's jobs cannot run here.
    loop_turned_at = float("inf")
    _stopped = False
    _beats = 0
    _serving_written: str | None = None

    def heartbeat(self, client: Redis | None = None) -> None:
        """Say this worker is alive and which tiers it serves (before its first fetch, then every second),
        and hold or take the housekeeper lease."""
        tiers = ",".join(t.label for t in self.served.tiers)
        # The tiers it serves are written when they change, and every SERVING_REWRITE beats (a Redis that
        # restarted without its data learns them again): an idle beat is a few commands.
        self._beats += 1
        fresh = tiers != self._serving_written or self._beats % SERVING_REWRITE == 0
        # The lease is held only while this worker's event loop turns (the fleet's jobs run there): a task
        # under the solo pool, or a warm shutdown, hands it to another worker within a beat.
        can_work = not self._stopped and time.monotonic() - self.loop_turned_at < LOOP_STALE_AFTER
        held = self._beat(
            keys=[
                self.settings.heartbeats_key,
                self.settings.serving_key,
                self.settings.housekeeper_key,
                self.settings.slots_key,
            ],
            args=[self.worker_name, tiers if fresh else "", int(self._lease() * 1000) if can_work else 0, self.slots],
            client=client or self.channel.client,
        )
        self._serving_written = tiers
        self.housekeeper = bool(held)

    def _lease(self) -> float:
        """The housekeeper lease: no longer than the shortest ``prio_redeliver_after``. A holder silent that
        long is dead by the fleet's own rule, and its successor's sweep must not wait for more than that."""
        return min(HOUSEKEEPER_LEASE, *self.settings.redeliver_after.values())

    def restore_or_dead_letter(self, tag: str) -> None:
        """Back to its queue through kombu's restore (marked redelivered); one kombu cannot read back (nested
        too deep, say) goes to the dead letters instead, so no pass ever stops at it."""
        try:
            self.channel.qos.restore_by_tag(tag, client=self.channel.client, leftmost=False)
        except self.channel.connection_errors:
            raise
        except Exception as exc:
            self._dead_letter_unacked(tag, decode_problem(exc))

    def _dead_letter_unacked(self, tag: str, reason: str) -> None:
        """A swept message kombu cannot restore: to the dead letters as it was stored, owner and all forgotten."""
        entry = self.channel.client.hget(self.channel.unacked_key, tag)
        if entry is None:  # settled meanwhile: only the owner record is left
            self.channel.client.hdel(self.settings.owners_key, tag)
            return
        raw, queue = split_unacked_entry(entry)
        tier = self.settings.tier_for_queue(queue) or self.settings.default_tier
        self._dead_letter_raw(raw, f"{reason}; found when its worker was gone", tier, queue, tag)

    def broker_figures(self, now: float, idle: bool = False) -> BrokerFigures:
        wall = time.time()
        if idle:  # every queue it serves was empty just now: nothing waits, nothing to ask about them
            oldest: dict[Tier, float | None] = dict.fromkeys(TIERS)
        else:
            client = self.channel.client
            oldest = {t: figures.oldest_age(client, self.settings.queue_name(t), wall) for t in TIERS}
        return BrokerFigures(
            counters=figures.counters(self.channel.client, self.settings),
            oldest_age=oldest,
            depth=dict.fromkeys(self.served.tiers, 0) if idle else self.served_depths(),
            read_at=now,
            dead_letters=self.dead_letter_depth(),
        )

    def queue_depths(self, names: list[str]) -> list[int]:
        return indexed_depths(self.channel.client, self.settings, names)


#: Seconds between marks that the worker's event loop turns, and the age of the last mark after which the
#: heartbeat gives the housekeeper lease up (the loop is held: a task under the solo pool).
LOOP_MARK_INTERVAL = 0.5
LOOP_STALE_AFTER = 2.0
