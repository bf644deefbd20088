"""What a Redis worker does for the fleet on its event loop: return gone workers' messages, report
rates, share estimates, prune, cap the dead letters, age."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ...policy.admission import NEWS_INTERVAL, FleetRecord, has_news
from ...policy.served import AGING_TIERS
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ..base import Job
from ..shared import as_text
from ..soon import PACE_INTERVAL, Soon
from . import figures
from .aging import RedisAging
from .pruning import PRUNE_INTERVAL, mention, prune
from .ready import HEAL_INTERVAL, ReadyHeal
from .scripts import SWEEP_DEAD_OWNERS, TRIM_DEAD

if TYPE_CHECKING:
    from kombu.transport.redis import Channel as RedisChannel


logger = logging.getLogger(__name__)

#: How often, and how many at most per call, the oldest dead letters beyond ``prio_dead_letter_max`` go.
DEAD_CAP_INTERVAL = 5.0
DEAD_CAP_STEP = 10_000

#: How often the fleet looks for messages of workers that are gone (prompt recovery; the beat itself
#: comes from a thread, ``liveness``).
SWEEP_INTERVAL = 1.0
#: How often the housekeeper sums the live slots per tier for admission by predicted wait, and writes the sum
#: again when it has not changed; the sum lives three intervals (a housekeeper gone, publishes admit by cap
#: alone until the next one writes it). Every 0.5 s, a steady fleet's sums were 16 of an idle one-worker
#: fleet's 46 Redis commands a second; every second, 8.
ADMISSION_INTERVAL = 1.0
#: While the sum moved in the last ``SLOTS_SETTLE`` seconds (a cold fleet, workers joining or leaving) it is
#: read every ``SLOTS_INTERVAL``; a steady fleet's every ``ADMISSION_INTERVAL`` (read every 0.1 s for good, it
#: cost an idle fleet's Redis 40 commands a second and woke every worker's loop ten times a second).
SLOTS_INTERVAL = 0.1
SLOTS_SETTLE = 5.0
ADMISSION_TTL_MS = int(3 * ADMISSION_INTERVAL * 1000)
ESTIMATES_INTERVAL = 0.5

#: Owner records one sweep call reads (about 3 ms of Redis); a pass reads at most
#: ``SWEEP_CHUNKS_PER_PASS`` of them each second and the next pass goes on from the fleet's cursor.
SWEEP_BATCH = 1000
SWEEP_CHUNKS_PER_PASS = 50


def sweep_keys(settings: PrioSettings) -> list[str]:
    """The sweep's lock (one sweeper a second for the fleet) and its HSCAN cursor."""
    return [settings.owners_key + ".sweep", settings.owners_key + ".sweep_cursor"]


#: How often a worker reports its per-tier take rate (publishers' Retry-After).
RATE_INTERVAL = 2.0
#: How often a worker that has queues it never measured reads the fleet's estimates of them.
ESTIMATES_READ_INTERVAL = 10.0


class HousekeptSource(Protocol):
    """What the jobs need of the worker's fetch source (``RedisFetchSource``)."""

    settings: PrioSettings
    worker_name: str
    channel: RedisChannel


def _record(estimates: Mapping[str, str]) -> FleetRecord:
    """Written estimates (their text) as a record, for ``has_news``."""
    return FleetRecord(estimates={name: float(v) for name, v in estimates.items()})


class RedisHousekeeping:
    """The jobs of one worker's fetch source (``source``: its channel, settings and names)."""

    def __init__(self, source: HousekeptSource) -> None:
        self.source = source
        self.settings = source.settings
        self.worker_name = source.worker_name
        self._sweep = source.channel.client.register_script(SWEEP_DEAD_OWNERS)
        self.aging = RedisAging(source.channel.client)
        self.returned = 0  # messages of gone workers this worker returned to their queues
        self._rate_mark: tuple[float, dict[Tier, int]] | None = None
        self._rates_idle = False  # the last rates written were all zero (nothing to refresh while idle)
        self._estimates_written: dict[str, str] = {}
        self.ready_heal = ReadyHeal(self.settings)
        self._estimates_read_at = float("-inf")
        self._estimates_shared_at = float("-inf")
        self._slots_shared: dict[Tier, float] = {}
        self._slots_shared_at = float("-inf")
        self._slots_moved_at = float("-inf")
        self._slots_soon = Soon(self._share_slots, SLOTS_INTERVAL, "sum the slots serving each tier (admission)")

    @property
    def channel(self) -> RedisChannel:
        return self.source.channel

    def jobs(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        # The fleet's work, done by the one worker that holds the housekeeper lease (``heartbeat.lua``):
        # its broker work per second does not grow with the number of workers.
        fleet = [
            Job(SWEEP_INTERVAL, self._return_dead_owners_messages, "return the messages of workers that are gone"),
            Job(PRUNE_INTERVAL, self._prune, "prune workers, estimates and sub-queues unheard of"),
            Job(HEAL_INTERVAL, self._heal_ready, "put lists with work back into the ready index"),
        ]
        if self.settings.dead_letter_max is not None:
            fleet.append(Job(DEAD_CAP_INTERVAL, self._cap_dead_letters, "keep the dead letters under their cap"))
        admits = any(budget is not None for budget in self.settings.max_wait.values())
        if admits:
            # Summed every ADMISSION_INTERVAL, and every SLOTS_INTERVAL while the sum moves (a cold fleet needs
            # them from its first runs); written when they change.
            self._slots_soon.hub = getattr(self.source, "hub", None)
            fleet.append(Job(ADMISSION_INTERVAL, self._share_slots, "sum the slots serving each tier (admission)"))
        if any(self.settings.aging[t] is not None for t in AGING_TIERS):
            # The housekeeper ages every tier, whatever its own -Q: offline ages into batch with no offline
            # worker at all.
            fleet.append(Job(self.settings.aging_interval, self._age, "aging"))
        # This worker's own: bounded by its own traffic (written when they change, nothing while idle).
        own = [
            Job(SWEEP_INTERVAL, self.source.settle_unsettled, "settle acks that failed while Redis was away"),
            Job(RATE_INTERVAL, lambda: self._report_rates(dispatched()), "report drain rates"),
            # Where a wait budget reads them: written within NEWS_INTERVAL of a run of a queue not written yet (a
            # cold fleet learns from its first runs), else looked at every PACE_INTERVAL and written then if one
            # moved, or every ESTIMATES_INTERVAL. (Polled every NEWS_INTERVAL, an idle worker's loop woke 40
            # times a second for nothing.)
            Job(PACE_INTERVAL if admits else RATE_INTERVAL, self._share_estimates, "share run-time estimates"),
        ]
        if admits:
            soon = Soon(self._share_estimates, NEWS_INTERVAL, "share run-time estimates")
            soon.hub = getattr(self.source, "hub", None)
            written = self._estimates_written

            def ran(queue: str) -> None:
                if queue not in written:
                    soon.nudge()

            self.source.served.on_run = ran
        return [*map(self._housekeeper_only, fleet), *own]

    def _housekeeper_only(self, job: Job) -> Job:
        def run() -> None:
            if self.source.housekeeper:
                job.run()

        return Job(job.interval, run, f"{job.name} (the fleet's housekeeper)")

    def _share_slots(self) -> None:
        """The live slots serving each tier, for the publish script's predicted wait (``guarded_push.lua``)."""
        if not self.source.housekeeper:  # a look the pace asked for after the lease moved on
            return
        slots = figures.slots_serving(self.channel.client, self.settings)
        now = time.monotonic()
        if slots != self._slots_shared:
            self._slots_moved_at = now
        if now - self._slots_moved_at < SLOTS_SETTLE:
            self._slots_soon.nudge()
        if slots == self._slots_shared and now - self._slots_shared_at < ADMISSION_INTERVAL:
            return
        self._slots_shared, self._slots_shared_at = slots, now
        key = self.settings.admission_key
        pipe = self.channel.client.pipeline(transaction=True)
        pipe.hset(key, mapping={f"slots:{tier.label}": f"{count:.3f}" for tier, count in slots.items()})
        pipe.pexpire(key, ADMISSION_TTL_MS)
        pipe.execute()

    def _return_dead_owners_messages(self) -> None:
        """Put back, at the head of their queues, messages fetched by workers that are gone.

        kombu restores an unacked message only after ``visibility_timeout``
        (an hour by default), and scans every app's unacked messages in the
        database to do it. Here every fetch records its worker, every worker
        beats each second, and any live worker returns a message whose
        worker has been silent for longer than its tier's
        ``prio_redeliver_after`` (realtime 5 s by default), whatever the
        visibility timeout: a long task on a live worker is never returned,
        and only this app's messages are looked at. The message goes back
        through kombu's own restore (marked redelivered, to the list it came
        from); the sweep script hands each one to a single sweeper. The
        tiers' doorbells ring for what came back, so idle workers take it.
        """
        channel, settings = self.channel, self.settings
        limits: list[Any] = []
        for tier, seconds in settings.redeliver_after.items():
            limits += [tier.label, seconds]
        returned = 0
        try:
            for _ in range(SWEEP_CHUNKS_PER_PASS):  # chunk by chunk: Redis serves others in between
                reply = self._sweep(
                    keys=[settings.owners_key, settings.heartbeats_key, *sweep_keys(settings)],
                    args=[self.worker_name, SWEEP_BATCH, *limits],
                    client=channel.client,
                )
                if not reply:  # another worker sweeps this second
                    break
                for tag in reply[1:]:
                    self.source.restore_or_dead_letter(as_text(tag))
                returned += len(reply) - 1
                if as_text(reply[0]) == "0":  # the pass reached the end of the hash
                    break
        except channel.connection_errors:
            pass  # what this sweep took but did not restore is taken again after 10 s (by any worker)
        if returned:
            logger.warning("celery-prio: returned %d message(s) of workers that are gone to their queues", returned)
            self.returned += returned
            self.source.ring(TIERS, returned)

    def _heal_ready(self) -> None:
        missing = self.ready_heal.run(self.channel)
        if missing:
            logger.info(
                "celery-prio: %d list(s) with work were missing from %s: a producer that does not keep it "
                "(an older celery-prio, a plain kombu client) published to them; they are served again",
                missing,
                self.settings.ready_key,
            )

    def _prune(self) -> None:
        gone = prune(self.channel.client, self.settings, self.worker_name)
        if any(gone.values()):
            logger.info("celery-prio: pruned what nobody mentioned for prio_prune_after: %s", gone)

    def _cap_dead_letters(self) -> None:
        client, settings = self.channel.client, self.settings
        dropped = client.eval(
            TRIM_DEAD, 2, settings.dead_letter_queue, settings.stats_key, settings.dead_letter_max, DEAD_CAP_STEP
        )
        if dropped:
            logger.warning(
                "celery-prio: dropped the %d oldest dead letters (prio_dead_letter_max=%d)",
                dropped,
                settings.dead_letter_max,
            )

    def _share_estimates(self) -> None:
        """Run-time estimates of the queues inside the tiers, shared by the fleet (shortest-job-first order).

        Each worker writes what it measured and takes, for the queues it has
        not measured yet, what the others did: a worker that starts (or a
        task name it never ran) orders by the fleet's figures from the first fetch.
        """
        key = self.settings.estimates_key
        states = [(name, state) for _, name, state in self.source.served.queue_states()]
        mine = {name: f"{each:.6f}" for name, each in self.source.served.per_call_estimates().items()}
        changed = {name: v for name, v in mine.items() if self._estimates_written.get(name) != v}
        client = self.channel.client
        now = time.monotonic()
        due = now - self._estimates_shared_at >= ESTIMATES_INTERVAL
        # News is looked for only when something changed before it is due (not on every idle tick).
        if changed and (due or has_news(_record(self._estimates_written), _record(mine))):
            self._estimates_shared_at = now
            client.hset(key, mapping=changed)
            mention(client, self.settings, "estimates", list(changed))
            self._estimates_written.update(changed)
        if all(state.measured for _, state in states) or now - self._estimates_read_at < ESTIMATES_READ_INTERVAL:
            return
        self._estimates_read_at = now
        fleet = client.hgetall(key)
        for name, state in states:
            raw = fleet.get(name.encode())
            if state.measured or raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:  # anyone can write to Redis: a bad figure is skipped
                continue
            if value >= 0 and value == value:
                state.estimate, state.measured = value, True

    def _report_rates(self, counts: Mapping[Tier, int]) -> None:
        """Publish this worker's per-tier take rate; publishers turn it into Retry-After."""
        now = time.monotonic()
        last_at, last = self._rate_mark or (now, dict(counts))
        self._rate_mark = (now, dict(counts))
        if now <= last_at:
            return
        rates = {tier: (counts[tier] - last[tier]) / (now - last_at) for tier in TIERS}
        idle = not any(rates.values())
        if idle and self._rates_idle:
            return  # zeros are written once: a zero rate counts for nothing, fresh or not
        wall = time.time()
        mapping = {f"{self.worker_name}|{tier.label}": f"{rate:.4f} {wall:.3f}" for tier, rate in rates.items()}
        self.channel.client.hset(f"{self.settings.stats_key}.rates", mapping=mapping)
        self._rates_idle = idle

    def _age(self) -> None:
        now = time.time()
        subqueues = self.source.discover_subqueues() or []
        if subqueues:  # only sub-queues with work are looked at: 500 idle tenants cost no round trip each
            ready = self.channel.client.zrange(self.settings.ready_key, 0, 0, byscore=True)  # lingering: empty
            with_work = {as_text(m) for m in ready}
            subqueues = [name for name in subqueues if name in with_work or not self.settings.is_indexed(name)]
        for tier in AGING_TIERS:  # batch -> realtime first, so offline -> batch finds room
            self.aging.promote_aged(self.settings, tier, now)
            for name in subqueues:  # one pass per sub-queue: every worker ages, whatever its -Q
                if self.settings.subqueue_of(name, tier) is not None:
                    self.aging.promote_aged(self.settings, tier, now, source=name)
