"""RabbitMQ: a publisher's admission by predicted wait, without a broker round trip per publish.

Redis predicts a call's wait inside its publish script, atomically. On
RabbitMQ the publisher predicts it before publishing, from two readings it
keeps on a connection of its own (one per process, opened again after a
fork):

* **The work ahead** of a call: the depth of the queues it waits behind
  (its tier's queue, the tier's front lane, and its own sub-queue), read
  with a passive declare at most every ``DEPTH_FRESH`` seconds, times their
  estimates; drained since at the rate of the tier's slots, plus this
  process's calls admitted since (``Backlog``: a fluid queue).
* **The fleet's record** (live slots per tier, run-time estimates per queue),
  which the workers' housekeeper keeps in ``<prefix>.admission``
  (``fleet_figures.py``), read at most every ``RECORD_FRESH`` seconds.

The error is bounded and stated in the docs (guides/capacity): the depth
misses what *other* processes published within the last ``DEPTH_FRESH``
seconds (their rate times 0.1 s messages), and calls waiting in the tier's
other sub-queues are not counted. The record is at most about a
second old. No record (no housekeeper, a fleet that has not measured a run
yet) or a reading that fails: admitted by the cap alone, as on Redis.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import amqp
from amqp.exceptions import NotFound

from ...errors import QueueFull
from ...policy.admission import Backlog, FleetRecord
from ...tiers import Tier
from .fleet_figures import declare_record_queue, read_fleet_record

if TYPE_CHECKING:
    from celery import Celery

    from ...settings import PrioSettings

logger = logging.getLogger(__name__)

#: Seconds a depth reading is used for (plus this process's own publishes since).
DEPTH_FRESH = 0.1
#: Seconds the fleet's record is used for before it is read again; sooner while it has no estimate of the
#: call's queue (a cold fleet: the first runs' estimates are on their way).
RECORD_FRESH = 0.5
COLD_RECORD_FRESH = 0.01
#: For this long after a process first publishes to a queue, at most: a queue no worker ever runs stays
#: without an estimate, and is then read at the usual pace.
COLD_FOR = 10.0
#: A process sends its refusal counts to the housekeeper at most this often.
TALLY_EVERY = 0.5
#: After a reading failed (broker away), the readings are tried again after this long; meanwhile the cap rules.
RETRY_AFTER_FAILURE = 1.0


class AmqpAdmission:
    """One app's readings in one process (thread-safe: one lock, held for the readings, never for a publish)."""

    def __init__(self, app: Celery) -> None:
        self._app = weakref.ref(app)  # like its publisher's: the runtime must not keep its app alive
        self.refused = 0  # calls this process refused for their predicted wait
        self._lock = threading.Lock()
        self._pid = 0
        self._connection: Any = None
        self._channel: Any = None
        self._record: FleetRecord | None = None
        self._record_at = float("-inf")
        self._backlogs: dict[str, Backlog] = {}  # queue -> the work ahead of a call to it
        self._first_seen: dict[str, float] = {}  # queue -> when this process first published to it
        self._tally: dict[str, int] = {}  # refusals not sent to the housekeeper yet (``_send_tally``)
        self._tally_sent_at = float("-inf")
        self._tally_timer: threading.Timer | None = None
        self._failed_at = float("-inf")
        self._settings: PrioSettings | None = None

    def admit(self, settings: PrioSettings, tier: Tier, queue: str) -> None:
        """Raise ``QueueFull`` (reason ``"wait"``) if a call to ``queue`` of ``tier`` would wait past the tier's
        ``prio_max_wait``; otherwise count it as published (it waits there until the next depth reading)."""
        budget = settings.max_wait[tier]
        if budget is None:
            return
        with self._lock:
            self._settings = settings
            self._after_fork()
            now = time.monotonic()
            if now - self._failed_at < RETRY_AFTER_FAILURE:
                return
            try:
                record = self._fleet_record(settings, now, queue)
                slots = 0.0 if record is None else record.slots.get(tier, 0.0)
                if slots <= 0:
                    return  # nothing measured or no live worker known: the cap alone
                backlog = self._backlog(settings, tier, queue, record, now)
            except Exception as exc:  # a reading must never fail a publish: the cap still bounds the tier
                self._lost(exc)
                return
            wait = backlog.drained(now, slots) / slots
            refused = wait > budget
            if refused:
                self.refused += 1
                self._count(f"refused_wait:{tier.label}")
            else:
                backlog.work += record.estimates.get(queue) or 0.0  # waits there until the next reading
                backlog.admitted += 1
            self._send_tally(now)
            if refused:
                raise QueueFull.over_budget(tier, backlog.messages + backlog.admitted, wait, budget)

    def count_rejected(self, settings: PrioSettings, tier: Tier) -> None:
        """A publish the broker refused at the tier's cap (a confirm's nack): counted for the fleet too."""
        with self._lock:
            self._settings = settings
            self._after_fork()
            self._count(f"rejected:{tier.label}")
            self._send_tally(time.monotonic())

    def _count(self, counter: str) -> None:
        self._tally[counter] = self._tally.get(counter, 0) + 1

    def _send_tally(self, now: float) -> None:
        """This process's refusals since it last sent them, to the housekeeper (at most every ``TALLY_EVERY``;
        no round trip). Counted there into the fleet's record, which every worker reports (``prio status``,
        ``/metrics``, Flower). Not sent now (the broker away): sent with the next."""
        if not self._tally:
            return
        if now - self._tally_sent_at < TALLY_EVERY or now - self._failed_at < RETRY_AFTER_FAILURE:
            self._send_later()  # the last refusals of a burst are counted even if nothing is published after
            return
        settings = self._settings
        body = json.dumps({"refused": self._tally})
        try:
            self._ready_channel().basic_publish(amqp.Message(body), exchange="", routing_key=settings.housekeeper_key)
        except Exception as exc:
            self._lost(exc)
            return
        self._tally, self._tally_sent_at = {}, now

    def _send_later(self) -> None:
        if self._tally_timer is not None and self._tally_timer.is_alive():
            return

        def send() -> None:
            with self._lock:
                if self._pid == os.getpid():  # a forked child's copy of the tally is its parent's to send
                    self._send_tally(time.monotonic())

        self._tally_timer = threading.Timer(TALLY_EVERY, send)
        self._tally_timer.daemon = True
        self._tally_timer.start()

    def _fleet_record(self, settings: PrioSettings, now: float, queue: str) -> FleetRecord | None:
        record = self._record
        first = self._first_seen.setdefault(queue, now)
        cold = (record is None or queue not in record.estimates) and now - first < COLD_FOR
        fresh = COLD_RECORD_FRESH if cold else RECORD_FRESH
        if now - self._record_at < fresh:
            return record
        record = read_fleet_record(self._ready_channel(), settings)
        self._record, self._record_at = record, now
        return record

    def _backlog(self, settings: PrioSettings, tier: Tier, queue: str, record: FleetRecord, now: float) -> Backlog:
        """The work ahead of a call to ``queue`` of ``tier``: read again (a passive declare of the tier's queue,
        its front lane and ``queue``) when ``DEPTH_FRESH`` old; in between, no broker call and no name built."""
        backlog = self._backlogs.get(queue)
        if backlog is not None and now - backlog.read_at < DEPTH_FRESH:
            return backlog
        lane = settings.front_lanes().get(tier)
        names = list(dict.fromkeys(n for n in (settings.queue_name(tier), lane, queue) if n))
        depths = [self._depth(name) for name in names]
        work = sum(d * (record.estimates.get(n) or 0.0) for n, d in zip(names, depths, strict=True))
        backlog = self._backlogs[queue] = Backlog(now, sum(depths), work, now)
        return backlog

    def _depth(self, name: str) -> int:
        try:
            return int(self._ready_channel().queue_declare(queue=name, passive=True).message_count)
        except NotFound:  # not declared yet (a sub-queue's first call): nothing waits there
            self._channel = None  # a failed passive declare closes its channel
            return 0

    def _after_fork(self) -> None:
        """In a forked child: the parent's connection is not this process's to use, nor its tally to send."""
        if self._pid != os.getpid():
            self._connection, self._channel, self._pid = None, None, os.getpid()
            self._tally, self._tally_timer = {}, None

    def _ready_channel(self) -> Any:
        if self._connection is None:
            app = self._app()
            if app is None:
                raise RuntimeError("celery-prio: the app these readings were made for is gone")
            self._connection = app.connection_for_write()
            self._connection.ensure_connection(max_retries=1)
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.connection.channel()
            declare_record_queue(self._channel, self._settings)  # the workers' housekeeper may not have yet
        return self._channel

    def _lost(self, exc: BaseException) -> None:
        logger.warning("celery-prio: admission readings failed (%r); admitting by the cap alone for a while", exc)
        self._failed_at = time.monotonic()
        connection, self._connection, self._channel = self._connection, None, None
        self._backlogs.clear()
        self._record, self._record_at = None, float("-inf")
        if connection is not None:
            try:
                connection.release()
            except Exception:
                pass


__all__ = ["DEPTH_FRESH", "RECORD_FRESH", "AmqpAdmission"]
