"""Boost on RabbitMQ: publish a lifted copy, and make every worker skip the stale original.

A RabbitMQ queue gives up messages only from its head, so the queued
original cannot be moved. Instead:

1. The message comes from this process's memory of what it published
   (:class:`RecentPublishes`, the last ``prio_boost_memory`` tasks bound for
   batch or offline): **on RabbitMQ a task is boosted from the process that
   published it** (the HTTP front door, the orchestrating process, the task
   that spawned it). Elsewhere ``boost`` answers ``not_found``.
2. The boost is *prepared* in the journal ``<prefix>.boosts`` (a stream,
   kept 24 h by the broker's clock) with a publisher confirm. Records are
   signed, as are the ``prio_supersede`` broadcasts and the workers'
   answers (HMAC-SHA256, ``celery_prio/signing.py``: ``prio_boost_key``, or
   a key derived from the broker's credentials; none where that would be
   guessable, and then boosts are refused): what anyone else wrote to the
   stream or broadcast on the vhost is ignored.
3. Every live worker must answer ``prio_supersede`` (a broadcast with
   replies): each records "copies of this id below generation n are stale"
   as *pending*, or answers that it holds the task now (then nothing is
   published and the record is withdrawn, in the journal too). Live workers
   are counted exactly: each consumes from ``<prefix>.fleet`` while its
   connection is up, so the queue's consumer count is the fleet, and the
   answers are matched to distinct workers (one per node name). A worker
   answers on the event loop that also runs its fetches, so its answer is
   exact. If fewer answer than are counted within ``prio_boost_timeout``,
   nothing is published (``refused``).
4. The copy (same id, generation n, the original enqueue stamp) goes to the
   tier's front lane, confirmed; only then is the boost *committed* (journal,
   then broadcast) and a worker that fetches the stale original acks it
   unrun (``superseded.py``). A worker that fetches the original while the
   boost is only pending waits for the commit, at most ``PENDING_FOR``
   seconds, then runs it: a booster that dies between the broadcast and the
   copy's publish never loses the task (it may run twice).

A worker that starts later joins the fleet before it fetches anything, then
reads the journal up to a marker it appends itself: a boost written before
the marker is in what it reads; one written after it counted this worker and
waited for its answer. So every copy but the newest is skipped, by every
worker, within the journal's 24 h.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import amqp

from ...headers import BOOST_GENERATION_HEADER, BOOSTED_HEADER, ENQUEUED_HEADER
from ...policy.superseded import PENDING_FOR
from ...settings import PrioSettings
from ...signing import NO_KEY, app_boost_key, sign, verified
from ...tiers import Tier
from ..base import Boost
from ..publishing import Booster, Publisher
from ..shared import boost_lane, tier_full
from .continuations import aging_expiration
from .registry import passive_declares, read_to_marker

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp import Connection as AmqpConnection
    from celery import Celery

logger = logging.getLogger(__name__)

#: How long the journal keeps a boost (a stale original fetched later than this would run).
JOURNAL_MAX_AGE = "24h"
#: Seconds a starting worker waits for the journal's next record (it reads to the end, however long).
JOURNAL_READ_TIMEOUT = 10.0


def journal_name(settings: PrioSettings) -> str:
    return f"{settings.queue_prefix}.boosts"


def fleet_name(settings: PrioSettings) -> str:
    return f"{settings.queue_prefix}.fleet"


#: A boost journal record as ``Superseded.merge`` takes it: ``[id, generation, None]``, ``+ ["pending"]``.
JournalRecord = list[str | int | None]


@dataclass
class Published:
    """One task message as this process published it (what a lifted copy is made of)."""

    tier: Tier
    queue: str
    body: object
    headers: dict
    properties: dict
    generation: int = 0  # boosts so far
    size: int = 0  # about how many bytes it holds (``approx_size``): the memory is bounded by bytes too


def approx_size(value: object, budget: int = 200) -> int:
    """About how many bytes ``value`` (a task's args and kwargs) weighs, in bounded time: long lists are
    sampled, not walked, so a 4,096-image batch costs as much to weigh as a small one."""
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value) + 16
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value) if not isinstance(value, (list, tuple)) else value
        if not items:
            return 16
        step = max(1, len(items) // max(1, min(budget, 20)))
        sample = items[::step][: max(1, budget)]
        each = max(1, budget // len(sample))
        return 16 + sum(approx_size(x, each) for x in sample) * len(items) // len(sample)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, tensors' numpy views
    return int(nbytes) if isinstance(nbytes, int) else 16


class RecentPublishes:
    """The last ``size`` batch/offline task messages this process published, by task id.

    Filled from Celery's publish signals: ``before_task_publish`` notes the
    message, ``after_task_publish`` (the broker took it) keeps it.
    """

    def __init__(self) -> None:
        self.size = 0
        self.max_bytes = 0
        self.bytes = 0  # what the kept entries weigh, about
        self._settings: list[PrioSettings] = []
        self._entries: OrderedDict[str, Published] = OrderedDict()
        self._pending = threading.local()
        self.lock = threading.Lock()

    def watch(self, settings: PrioSettings) -> None:
        self.size = max(self.size, settings.boost_memory)
        self.max_bytes = max(self.max_bytes, settings.boost_memory_bytes)
        if all(s.queue_prefix != settings.queue_prefix for s in self._settings):
            self._settings.append(settings)

    def _tier(self, queue: object) -> Tier | None:
        if not isinstance(queue, str):
            return None
        for settings in self._settings:
            tier = settings.tier_for_queue(queue)
            if tier is not None:
                return tier
        return None

    def before_publish(
        self, body: object = None, routing_key: str | None = None, headers: object = None, **kw: object
    ) -> None:
        tier = self._tier(routing_key) if self.size else None
        if tier is None or tier is Tier.REALTIME or not isinstance(headers, dict) or routing_key is None:
            self._pending.value = None
            return
        size = approx_size(body)
        if size > self.max_bytes:  # bigger than the whole memory: not boostable from here (boost says not_found)
            self._pending.value = None
            return
        properties = kw.get("properties")
        kept = dict(properties) if isinstance(properties, dict) else {}
        self._pending.value = Published(tier, routing_key, body, headers, kept, size=size)

    def after_publish(self, headers: object = None, **_: object) -> None:
        pending: Published | None = getattr(self._pending, "value", None)
        self._pending.value = None
        if pending is None or pending.headers is not headers:
            return
        task_id = pending.headers.get("id")
        if not isinstance(task_id, str):
            return
        with self.lock:
            replaced = self._entries.pop(task_id, None)
            self.bytes += pending.size - (replaced.size if replaced else 0)
            self._entries[task_id] = pending
            while len(self._entries) > self.size or self.bytes > self.max_bytes:
                _id, old = self._entries.popitem(last=False)
                self.bytes -= old.size

    def get(self, task_id: str) -> Published | None:
        with self.lock:
            return self._entries.get(task_id)


class _AllAnswered(Exception):
    """Raised from the reply callback to stop collecting once every counted worker answered."""


class AmqpBooster(Booster):
    def __init__(self, publisher: Publisher, waiting: Callable[[Tier], int], recent: RecentPublishes) -> None:
        super().__init__(publisher)
        self._lock = threading.Lock()  # one boost at a time: concurrent boosts of one id publish one copy
        # Messages waiting in a tier (its queue, front lane and sub-queues): what a boost into it counts against
        # the tier's cap (``AmqpContinuations.waiting``, which sliced tasks ask too).
        self.waiting = waiting
        self.recent = recent  # what this process published of the app's batch/offline tasks

    def lift(self, task_id: str, tier: Tier) -> Boost | None:
        app, settings = self.app, self.settings
        published = self.recent.get(task_id)
        if published is None:
            return None
        lane = boost_lane(settings, tier)
        key = app_boost_key(app, settings)  # records, broadcasts and answers (None: boosts are refused)
        if key is None:
            return Boost("refused", task_id, tier, published.tier, detail=NO_KEY)
        with self._lock, app.connection_for_write() as conn:
            if published.tier <= tier:
                return Boost("already", task_id, tier, published.tier, detail="published or boosted at this tier")
            cap = settings.max_length[tier]
            if cap is not None and self.waiting(tier) >= cap:
                return Boost("refused", task_id, tier, published.tier, detail=tier_full(tier, cap))
            generation = published.generation + 1
            channel = conn.channel()
            write_journal(channel, settings, key, task_id, generation, "prepare")
            answers = self._ask_fleet(app, channel, settings, key, task_id, generation)
            if answers is None or any(a.get("held") for a in answers):
                self._withdraw(app, channel, settings, key, task_id, generation)
                if answers is None:
                    detail = "no worker is up, or not every worker answered within prio_boost_timeout"
                    return Boost("refused", task_id, tier, published.tier, detail=detail)
                return Boost("running", task_id, tier, published.tier, detail="a worker holds it")
            headers = dict(published.headers)
            history = headers.get(BOOSTED_HEADER)
            headers[BOOSTED_HEADER] = [*(history if isinstance(history, list) else []), published.tier.label]
            headers[BOOST_GENERATION_HEADER] = {"gen": generation}
            properties = {**published.properties, **aging_expiration(settings, tier, headers.get(ENQUEUED_HEADER))}
            try:
                with app.producer_or_acquire() as producer:
                    producer.publish(
                        published.body,
                        exchange="",
                        routing_key=lane,
                        headers=headers,
                        serializer=app.conf.task_serializer or "json",
                        delivery_mode=2,
                        retry=True,
                        declare=[],  # the lane exists: declared with the tier queues, before this task was published
                        **properties,
                    )
            except Exception:
                self._withdraw(app, channel, settings, key, task_id, generation)
                raise
            # The copy is on the broker: now, and only now, the original is stale for good.
            write_journal(channel, settings, key, task_id, generation, "commit")
            app.control.broadcast("prio_supersede", arguments=supersede_arguments(key, task_id, generation, "commit"))
            from_tier = published.tier
            published.tier, published.generation = tier, generation
            return Boost("boosted", task_id, tier, from_tier, published.queue)

    def _ask_fleet(
        self, app: Celery, channel: AmqpChannel, settings: PrioSettings, key: bytes, task_id: str, generation: int
    ) -> list[dict] | None:
        """Every live worker's answer to ``prio_supersede``; None when there is none, or one did not answer."""
        expected = fleet_size(channel, settings)
        if expected == 0:
            return None  # nobody to skip the original: the first worker to start would run both copies
        answers: dict[str, dict] = {}  # one per worker: a node answering twice is one answer

        def on_reply(reply: object) -> None:
            for node, answer in reply.items() if isinstance(reply, dict) else ():
                # Every Celery worker on the vhost hears the broadcast; only this app's prio workers count,
                # and only answers signed under the app's key (a forged "not held" would make a copy run twice).
                ours = isinstance(answer, dict) and answer.get("prefix") == settings.queue_prefix
                if ours and verified(key, answer.get("sig"), "answer", task_id, generation, bool(answer.get("held"))):
                    answers[str(node)] = answer
            if len(answers) >= expected:
                raise _AllAnswered

        try:
            app.control.broadcast(
                "prio_supersede",
                arguments={**supersede_arguments(key, task_id, generation, "pending"), "pending_for": PENDING_FOR},
                reply=True,
                timeout=settings.boost_timeout,
                callback=on_reply,
            )
        except _AllAnswered:
            pass
        return list(answers.values()) if len(answers) >= expected else None

    @staticmethod
    def _withdraw(
        app: Celery, channel: AmqpChannel, settings: PrioSettings, key: bytes, task_id: str, generation: int
    ) -> None:
        write_journal(channel, settings, key, task_id, generation, "withdrawn")
        app.control.broadcast("prio_supersede", arguments=supersede_arguments(key, task_id, generation, "retract"))


def supersede_arguments(key: bytes, task_id: str, generation: int, action: str) -> dict[str, object]:
    """A signed ``prio_supersede`` broadcast: ``pending`` (answer whether held), ``commit`` or ``retract``."""
    flags = {"commit": action == "commit", "retract": action == "retract"}
    return {
        "task_id": task_id,
        "generation": generation,
        **flags,
        "sig": sign(key, "supersede", task_id, generation, action),
    }


def declare_journal(channel: AmqpChannel, settings: PrioSettings) -> None:
    channel.queue_declare(
        queue=journal_name(settings),
        durable=True,
        auto_delete=False,
        arguments={"x-queue-type": "stream", "x-max-age": JOURNAL_MAX_AGE},
    )


#: A boost's records in the journal, in order: prepared, then committed or withdrawn.
PHASES = ("prepare", "commit", "withdrawn")


def write_journal(
    channel: AmqpChannel, settings: PrioSettings, key: bytes, task_id: str, generation: int, phase: str
) -> None:
    """Append one signed boost record to the journal, confirmed by the broker before returning."""
    declare_journal(channel, settings)
    record = {
        "id": task_id,
        "gen": generation,
        "phase": phase,
        "at": time.time(),  # for people reading the stream; expiry goes by the broker's clock (x-max-age)
        "sig": sign(key, task_id, generation, phase),
    }
    channel.basic_publish_confirm(
        amqp.Message(b"", application_headers=record, delivery_mode=2), exchange="", routing_key=journal_name(settings)
    )


def fleet_size(channel: AmqpChannel, settings: PrioSettings) -> int:
    """How many of this app's workers are up now: the consumers of ``<prefix>.fleet`` (exact, no cache)."""
    (ok,) = passive_declares(channel.connection, [fleet_name(settings)])
    return int(ok.consumer_count) if ok else 0  # None: no worker ever joined


def join_fleet(channel: AmqpChannel, settings: PrioSettings) -> None:
    """Count this worker in the fleet for as long as ``channel``'s connection is up."""
    from .topology import quorum_arguments

    # Quorum with the tier queues: on a cluster the count survives the loss of any one node.
    args = quorum_arguments(settings, {}) or None
    channel.queue_declare(queue=fleet_name(settings), durable=True, auto_delete=False, arguments=args)
    channel.basic_consume(queue=fleet_name(settings), no_ack=True, callback=lambda message: None)


#: Logged once a worker counts for boosts (before its first fetch); tests wait for it.
FLEET_JOINED = "joined the fleet"
#: Tries at reading the boost journal when a worker joins (a connection the broker closes is tried again).
JOURNAL_READ_TRIES = 3


def read_journal_joining(app: Celery, settings: PrioSettings) -> list[JournalRecord]:
    """The journal's boosts, read by a worker that just joined the fleet (on a connection of its own)."""
    records: list[JournalRecord] = []
    key = app_boost_key(app, settings)
    if key is None:  # no boost can be written, nor obeyed: nothing to read
        logger.info("celery-prio: %s, but %s; this worker ignores prio_supersede", FLEET_JOINED, NO_KEY)
        return records
    for attempt in range(JOURNAL_READ_TRIES):
        try:
            with app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=3)
                records = read_journal(conn.connection, settings, key)
            break
        except Exception:
            if attempt + 1 < JOURNAL_READ_TRIES:  # e.g. INTERNAL_ERROR while many workers declare it at once
                time.sleep(0.2 * (attempt + 1))
                continue
            # Counted in the fleet, so later boosts wait for this worker's answer; earlier ones are unknown.
            logger.exception("celery-prio: could not read the boost journal: originals of earlier boosts may run")
    logger.info("celery-prio: %s: boosts ask this worker; %d earlier boost(s) read", FLEET_JOINED, len(records))
    return records


def read_journal(connection: AmqpConnection, settings: PrioSettings, key: bytes) -> list[JournalRecord]:
    """Every boost in the journal, as ``Superseded.merge`` takes them: ``[id, gen, None]`` when committed,
    ``[id, gen, None, "pending"]`` when prepared and not (yet) committed; withdrawals applied.

    Reads to a marker appended here, however long the journal, so nothing
    written before the call is missed. Only records signed with ``key`` count.
    ``connection`` is a py-amqp connection of its own (this drains its events).
    """
    records: OrderedDict[str, tuple[int, bool]] = OrderedDict()  # id: (generation, pending)
    forged = 0

    def on_record(headers: dict) -> None:
        nonlocal forged
        task_id, gen, phase, sig = headers.get("id"), headers.get("gen"), headers.get("phase"), headers.get("sig")
        if not isinstance(task_id, str) or not isinstance(gen, int) or phase not in PHASES:
            return  # not a boost record: anyone can publish here
        if not verified(key, sig, task_id, gen, phase):
            forged += 1
            return
        known = records.get(task_id)
        if phase == "withdrawn":
            if known is not None and known[0] == gen:
                del records[task_id]
        elif phase == "prepare":
            if known is None or known[0] < gen:
                records[task_id] = (gen, True)
        elif known is None or known[0] <= gen:  # commit
            records[task_id] = (gen, False)

    declare = lambda channel: declare_journal(channel, settings)  # noqa: E731
    read_to_marker(connection, journal_name(settings), declare, on_record, JOURNAL_READ_TIMEOUT)
    if forged:
        logger.warning("celery-prio: ignored %d boost record(s) not signed with this app's key", forged)
    return [
        [task_id, gen, None, "pending"] if pending else [task_id, gen, None]
        for task_id, (gen, pending) in records.items()
    ]
