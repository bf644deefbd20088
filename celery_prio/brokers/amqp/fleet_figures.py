"""RabbitMQ: the fleet's figures for admission by predicted wait, shared through the broker itself.

A publisher needs two figures of the fleet to predict a call's wait: the
live slots serving its tier, and how long each queue's tasks run (what the
workers measure for shortest-job-first). RabbitMQ has no key a worker can
write and a publisher read in one call, so:

* **Reports.** Every worker serving a tier with a wait budget sends its own
  figures (the slots it gives each tier, its estimates per queue) every
  ``REPORT_INTERVAL`` to ``<prefix>.housekeeper``.
* **The housekeeper** is the worker whose connection declared that queue
  ``exclusive``: RabbitMQ lets no other connection declare or consume it
  while that connection lives, and deletes it when the connection closes,
  so the lease needs no clock and ends with its holder (the others look
  when a report of theirs comes back unroutable, its queue gone: reports go
  ``mandatory``, so the look costs no call, where trying every few seconds
  cost RabbitMQ a channel and an error reply per worker; at most every
  ``LEASE_RETRY``). It consumes the reports and every
  ``REPORT_INTERVAL`` publishes the fleet's record (slots summed over the
  workers heard from within ``REPORT_FRESH``; each queue's estimate their
  mean) to ``<prefix>.admission``. Both send sooner when there is news:
  within ``TICK_INTERVAL`` of a run of a queue the last report or record
  had no estimate of (a cold fleet learns from its first runs) or of a
  report that brings one (``nudge``); an estimate that moved, at the next
  look of the pace (``celery_prio.brokers.soon.PACE_INTERVAL``). Looks
  polled every ``TICK_INTERVAL`` woke an idle worker's loop a hundred times
  a second for nothing (1.7 % of a core each).
* **The record** queue holds one message (``x-max-length`` 1, ``drop-head``:
  the newest) that expires after ``RECORD_TTL_MS``: with no housekeeper,
  publishers soon admit by the cap alone. Publishers read it with
  ``basic_get`` and put it back (``admission.py``).

A report sent while there is no housekeeper comes back unroutable and is
dropped: nothing is lost but a figure, sent again two seconds later. Broker
cost: one small message per worker every ``KEEPALIVE`` (every
``REPORT_INTERVAL`` while its figures move by more than ``DRIFT_FACTOR``),
and one record; the record is read by a worker only for a report someone asked for.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import amqp
from amqp.exceptions import ChannelError, ResourceLocked

from ...policy.admission import FleetRecord, has_news, merge_reports, refusal_counts, slot_share
from ...settings import PrioSettings
from ...tiers import TIERS

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp import Connection as AmqpConnection

    from ...policy.served import ServedQueues

logger = logging.getLogger(__name__)

#: How often a worker reports, and the housekeeper publishes the fleet's record (a surge is followed within it).
REPORT_INTERVAL = 0.5
#: How often a worker looks for news (RabbitMQ's figures pass through the housekeeper and its record, so
#: tighter than Redis's ``NEWS_INTERVAL``: a cold fleet's first estimate reaches publishers within ~30 ms).
TICK_INTERVAL = 0.01
#: With nothing changed (an idle worker), a report or record goes this often: the record stays fresh, and a
#: worker's slots counted, for a few times as long (``REPORT_FRESH``, ``RECORD_TTL_MS``).
KEEPALIVE = 2.0
#: An estimate that moved by less than this factor, or this many seconds, since it was sent waits for the
#: ``KEEPALIVE`` pace.
DRIFT_FACTOR = 1.1
DRIFT_FLOOR = 0.001
#: A worker not heard from for this long no longer counts (its slots leave the sum).
REPORT_FRESH = 5.0
#: How long the record lives unrenewed: a housekeeper gone, publishes admit by the cap alone after it.
RECORD_TTL_MS = 5000
#: After an error reply, the figures are not shared for this long (one warning, not one per tick).
PAUSE_AFTER_ERROR = 5.0
#: How often a worker that is not the housekeeper tries to become it.
LEASE_RETRY = 2.0
#: Reports the housekeeper's queue keeps unread (a housekeeper whose loop is blocked: the oldest go).
INBOX_MAX = 10_000
#: Workers the housekeeper keeps figures of, and the longest worker key taken (anyone can publish to it).
MAX_WORKERS = 10_000
MAX_KEY = 200


def record_queue_arguments() -> dict[str, Any]:
    return {"x-max-length": 1, "x-overflow": "drop-head", "x-message-ttl": RECORD_TTL_MS}


def declare_record_queue(channel: AmqpChannel, settings: PrioSettings) -> None:
    """``<prefix>.admission``: the fleet's newest record (declared alike by workers and publishers)."""
    channel.queue_declare(
        queue=settings.admission_key, durable=True, auto_delete=False, arguments=record_queue_arguments()
    )


def read_fleet_record(channel: AmqpChannel, settings: PrioSettings) -> FleetRecord | None:
    """The fleet's newest record, left in its queue for the others (None: none, or not a record: anyone can
    publish to a queue)."""
    message = channel.basic_get(queue=settings.admission_key, no_ack=False)
    if message is None:
        return None
    channel.basic_reject(message.delivery_tag, requeue=True)
    try:
        return FleetRecord.from_json(json.loads(message.body))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None


def _moved(sent: FleetRecord | None, now: FleetRecord) -> bool:
    """Worth sending at the ``REPORT_INTERVAL`` pace: slots or counts changed, a queue measured for the first
    time, or an estimate that moved by ``DRIFT_FACTOR`` and ``DRIFT_FLOOR`` (a busy worker's estimates move a
    little with every run; each small move would be a message every ``REPORT_INTERVAL`` from every worker)."""
    if sent is None or (sent.slots, sent.counters) != (now.slots, now.counters):
        return True
    for name, each in now.estimates.items():
        before = sent.estimates.get(name)
        if before is None or abs(each - before) > max(before * (DRIFT_FACTOR - 1), DRIFT_FLOOR):
            return True
    return False


class FleetFigures:
    """One worker's side: its report, and the housekeeper's record while it holds the lease."""

    def __init__(self, settings: PrioSettings, served: ServedQueues, slots: Any) -> None:
        self.settings = settings
        self.served = served
        self.slots = slots  # () -> this worker's concurrency
        self.key = uuid.uuid4().hex  # this worker incarnation's key among the reports
        self.housekeeper = False
        self._connection: Any = None  # the connection the channels below live on
        self._channel: Any = None
        self._retry_at = 0.0
        self._unrouted = True  # a report came back unroutable: no housekeeper's queue (none sent yet: unknown)
        self._reports: dict[str, tuple[float, FleetRecord]] = {}  # worker key -> (heard at, its report)
        self._sent: FleetRecord | None = None  # what this worker last sent (its report, or the fleet's record)
        self._sent_at = float("-inf")
        self._news = False  # a report brought news since the last record (housekeeper)
        self._paused_until = float("-inf")
        self.counters: dict[str, int] = {}  # refusals the publishers counted (housekeeper), carried in the record
        self._report: FleetRecord | None = None  # own_report's, for _report_state
        self._report_state: tuple = ()
        self._record: FleetRecord | None = None  # the fleet's record as last read (not the housekeeper)
        self._record_at = float("-inf")
        self.nudge: Callable[[], None] = lambda: None  # a look within ``TICK_INTERVAL`` (set by the worker's loop)

    def ran(self, queue: str) -> None:
        """A run of ``queue`` ended: a look soon if it is the first the fleet would hear of (a cold start)."""
        sent = self._sent
        if sent is not None and queue in sent.estimates:
            return
        if self.settings.max_wait[self.served.tier_of(queue)] is not None:  # its tier has a wait budget
            self.nudge()

    def own_report(self) -> FleetRecord:
        """This worker's slots per tier (its concurrency split by the weights of the tiers it serves) and
        the estimates it measured, of the tiers with a wait budget. Built again only when what it is made of
        may have moved (a run, the queues served, the slots): a tick every 10 ms costs an idle worker nothing."""
        state = (self.served.version, self.served.runs, self.slots())
        if state != self._report_state or self._report is None:
            self._report, self._report_state = self._build_report(), state
        return self._report

    def _build_report(self) -> FleetRecord:
        settings, served = self.settings, self.served.tiers
        budgeted = {t for t in TIERS if settings.max_wait[t] is not None}
        slots = {t: slot_share(self.slots(), t, served, settings.weights) for t in TIERS if t in served}
        estimates = {name: round(each, 6) for name, each in self.served.per_call_estimates(budgeted).items()}
        return FleetRecord(slots, estimates)

    def tick(self, connection: AmqpConnection) -> None:
        """Every ``TICK_INTERVAL`` on the worker's loop: report, or, as the housekeeper, publish the record,
        when there is news, every ``REPORT_INTERVAL`` while the figures move, and every ``KEEPALIVE`` else.
        An error reply (the record's queue unavailable: its node down on a cluster) pauses it for
        ``PAUSE_AFTER_ERROR``: publishers admit by the cap meanwhile."""
        now = time.monotonic()
        if now < self._paused_until:
            return
        try:
            self._tick(connection, now)
        except ChannelError as exc:
            self._paused_until, self._channel = now + PAUSE_AFTER_ERROR, None
            logger.warning("celery-prio: admission figures not shared for %g s: %r", PAUSE_AFTER_ERROR, exc)

    def _kept_channel(self, connection: AmqpConnection) -> AmqpChannel:
        """The channel reports, records and record reads go on (the lease holds one of its own)."""
        if connection is not self._connection:  # a new connection: a lease held on the old one ended with it
            self._connection, self.housekeeper, self._retry_at, self._channel = connection, False, 0.0, None
            self._unrouted = True
        if self._channel is None or not self._channel.is_open:  # the lease (its own channel) is still held
            self._channel = connection.channel()
            self._channel.events["basic_return"].add(self._returned)
            declare_record_queue(self._channel, self.settings)
            self._sent = None
        return self._channel

    def _returned(self, exc: Exception, exchange: str, routing_key: str, message: object) -> None:
        """A ``mandatory`` report RabbitMQ could not route: the housekeeper's queue is gone (its holder too)."""
        if routing_key == self.settings.housekeeper_key:
            self._unrouted = True

    def fleet_record(self, connection: AmqpConnection, within: float) -> FleetRecord | None:
        """The fleet's record (for the refusals it counts): the housekeeper's own, or the one read within
        ``within`` seconds, else read now. None: none (no housekeeper for ``RECORD_TTL_MS``), or unreadable."""
        now = time.monotonic()
        if self.housekeeper and connection is self._connection:
            return FleetRecord(counters=dict(self.counters))
        if now - self._record_at > within:
            try:
                self._read_record(self._kept_channel(connection), now)
            except ChannelError:  # the record's queue unavailable (its node down on a cluster): no counts now
                self._channel, self._record = None, None
        return self._record

    def _read_record(self, channel: AmqpChannel, now: float) -> FleetRecord | None:
        self._record, self._record_at = read_fleet_record(channel, self.settings), now
        return self._record

    def _tick(self, connection: AmqpConnection, now: float) -> None:
        self._kept_channel(connection)
        mine = self.own_report()
        if not self.housekeeper and self._unrouted and now >= self._retry_at:
            self._take_lease(connection, now)
        if self.housekeeper:
            self._reports[self.key] = (now, mine)
            for key in [k for k, (at, _) in self._reports.items() if now - at > REPORT_FRESH]:
                del self._reports[key]
            mine = merge_reports(report for _, report in self._reports.values())
            mine.counters = dict(self.counters)
        every = REPORT_INTERVAL if _moved(self._sent, mine) else KEEPALIVE
        if now - self._sent_at < every and not self._news and not has_news(self._sent, mine):
            return
        if self.housekeeper:
            body, queue = json.dumps(mine.to_json()), self.settings.admission_key
        else:
            body, queue = json.dumps({"worker": self.key, "report": mine.to_json()}), self.settings.housekeeper_key
        # mandatory: a report no queue takes comes back (``_returned``), and this worker tries the lease.
        self._channel.basic_publish(amqp.Message(body), exchange="", routing_key=queue, mandatory=True)
        self._sent, self._sent_at, self._news = mine, now, False

    def _take_lease(self, connection: AmqpConnection, now: float) -> None:
        self._retry_at, self._unrouted = now + LEASE_RETRY, False
        channel = connection.channel()  # a refused declare closes its channel: this one only
        try:
            channel.queue_declare(
                queue=self.settings.housekeeper_key,
                exclusive=True,
                arguments={"x-max-length": INBOX_MAX, "x-overflow": "drop-head"},
            )
        except ResourceLocked:
            return  # another worker's connection holds it
        # The counts go on from the last housekeeper's record (Prometheus takes a reset, operators would not).
        before = read_fleet_record(self._channel, self.settings)
        self.counters = dict(before.counters) if before is not None else {}
        channel.basic_consume(self.settings.housekeeper_key, no_ack=True, callback=self._heard)
        self.housekeeper, self._reports = True, {}
        logger.info("celery-prio: this worker keeps the fleet's admission record (%s)", self.settings.admission_key)

    def _heard(self, message: Any) -> None:
        """A worker's report, or a publisher's refusals since its last (anyone can publish here: what is
        neither is skipped)."""
        try:
            data = json.loads(message.body)
        except (ValueError, TypeError, UnicodeDecodeError):
            return
        if isinstance(data, dict) and "refused" in data:
            for name, count in refusal_counts(data["refused"]).items():
                self.counters[name] = self.counters.get(name, 0) + count
            return
        key = data.get("worker") if isinstance(data, dict) else None
        report = FleetRecord.from_json(data.get("report")) if isinstance(key, str) and len(key) <= MAX_KEY else None
        if report is not None and (key in self._reports or len(self._reports) < MAX_WORKERS):
            self._reports[key] = (time.monotonic(), report)
            if not self._news and has_news(self._sent, report):
                self._news = True
                self.nudge()


__all__ = [
    "REPORT_INTERVAL",
    "TICK_INTERVAL",
    "FleetFigures",
    "declare_record_queue",
    "has_news",
    "record_queue_arguments",
]
