"""Redis: tier queues are lists; LPUSH adds on the left, RPOP takes the oldest on the right."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, PROMOTED_SUFFIX
from ..policy.aging import plan_promotions
from ..policy.served import AGING_TIERS, Candidate, ServedQueues
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from ..untrusted import decode_problem, decode_redis_element, enqueue_age
from .base import Broker, BrokerFigures, FetchSource, Job, Take
from .redis_liveness import PROCESS_HEARTBEAT
from .redis_pruning import PRUNE_INTERVAL, mention, prune
from .redis_scripts import (
    DEAD_HEAD,
    DEAD_LETTER,
    DEAD_REQUEUE,
    FETCH,
    HEARTBEAT,
    PROMOTE,
    SCRIPT_BYTES,
    STAMP,
    SWEEP_DEAD_OWNERS,
    TRIM_DEAD,
)
from .redis_transport import UNSETTLED, drain_rate, registered_subqueues

logger = logging.getLogger(__name__)

#: How many of the oldest elements one aging look reads (and may stamp).
AGING_WINDOW = 100
#: Garbage one aging pass moves aside at most: a pass stays short, the next goes on.
MAX_DEAD_PER_PASS = 1000


#: A worker whose last heartbeat (every second) is older than this no longer counts as serving its tiers.
PRESENCE_FRESH = 5.0


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RedisAdapter(Broker):
    kind = "redis"

    def __init__(self, app: Any, client: Any = None) -> None:
        super().__init__(app)
        self.connection = None
        if client is None:
            self.connection = app.connection_for_write()
            # The transport's own client: same URL, password, SSL and db as Celery uses.
            client = self.connection.default_channel.client
        self.client = client
        self._promote = self.client.register_script(PROMOTE)
        self._stamp = self.client.register_script(STAMP)
        self._dead_head = self.client.register_script(DEAD_HEAD)
        # Per source list: how deep the stamping look has reached beyond the head window.
        self._stamp_cursor: dict[str, int] = {}
        self._aging_window: dict[str, int] = {}  # per list: elements an aging look reads (bounded by bytes)

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def subqueues(self, settings: PrioSettings) -> list[str]:
        return registered_subqueues(self.client, settings.subqueue_registry)

    def serving(self, settings: PrioSettings) -> dict[Tier, int]:
        """Live workers per tier: a fresh heartbeat, and the tiers it last said it serves."""
        now = self.client.time()
        now = now[0] + now[1] / 1e6
        beats = self.client.hgetall(settings.heartbeats_key)
        out = dict.fromkeys(TIERS, 0)
        for worker, tiers in self.client.hgetall(settings.serving_key).items():
            try:
                alive = now - float(beats.get(worker, b"0")) <= PRESENCE_FRESH
            except ValueError:  # anyone can write to Redis: an unreadable beat is no live worker
                alive = False
            for label in _text(tiers).split(",") if alive else ():
                tier = next((t for t in TIERS if t.label == label), None)
                if tier is not None:
                    out[tier] += 1
        return out

    def delete_queues(self, queues: list[str]) -> None:
        for name in queues:
            self.client.delete(name, f"_kombu.binding.{name}")

    # -- capacity bookkeeping -----------------------------------------------
    def counters(self, settings: PrioSettings) -> dict[str, int]:
        """Broker-wide counters; a field that is not a whole number is skipped, not fatal."""
        out = {}
        for key, value in self.client.hgetall(settings.stats_key).items():
            try:
                out[_text(key)] = int(value)
            except ValueError:
                continue
        return out

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        return drain_rate(self.client, settings.stats_key, tier.label)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
        """Oldest first. An entry that is not a dead-letter envelope is listed as malformed."""
        return [
            describe_dead_entry(raw) for raw in reversed(self.client.lrange(settings.dead_letter_queue, -limit, -1))
        ]

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int, int]:
        """Back where they came from: ``(moved, left, skipped)``. Only this app's queues are destinations:
        tier queues, front lanes and the tiers' sub-queues (shortest-first queues and tenants)."""
        caps: list[Any] = []
        for tier in TIERS:
            cap, sub_cap = settings.max_length[tier], settings.subqueue_cap(tier)
            caps += [settings.queue_name(tier), cap if cap is not None else -1]
            caps += [settings.queue_name(tier) + PROMOTED_SUFFIX, -1]
            caps += [settings.queue_name(tier) + ".", sub_cap if sub_cap is not None else -1]
        # Chunk by chunk (each call bounded in entries and bytes): Redis serves others in between, and an
        # interrupted requeue has moved whole entries only. Each entry is looked at once per requeue.
        requeue = self.client.register_script(DEAD_REQUEUE)
        to_look = self.client.llen(settings.dead_letter_queue)
        moved = skipped = 0
        left = to_look
        while to_look > 0 and (limit is None or moved < limit):
            chunk = min(REQUEUE_CHUNK, to_look)
            want = REQUEUE_CHUNK if limit is None else limit - moved
            m, left, s, looked, full = (
                int(x) for x in requeue(keys=[settings.dead_letter_queue], args=[want, chunk, *caps])
            )
            moved, skipped, to_look = moved + m, skipped + s, to_look - looked
            if full or looked == 0:
                break
        return moved, int(left), skipped

    def dead_purge(self, settings: PrioSettings) -> int:
        with self.client.pipeline() as pipe:
            pipe.llen(settings.dead_letter_queue)
            pipe.delete(settings.dead_letter_queue)
            count, _ = pipe.execute()
        return int(count)

    # -- aging --------------------------------------------------------------
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
                    keys=[source, promoted, upper, settings.stats_key],
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

    def oldest_age(self, queue: str, now: float) -> float | None:
        """Seconds the oldest waiting message of ``queue`` has waited (None if empty, unstamped or malformed)."""
        raw = self.client.lindex(queue, -1)
        if raw is None:
            return None
        message, _ = decode_redis_element(raw)
        return None if message is None else enqueue_age(message.get("headers"), now)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.release()


def _fitting(element_bytes: float, most: int) -> int:
    """How many elements of about ``element_bytes`` fit in ``SCRIPT_BYTES`` (1 to ``most``)."""
    return max(1, min(most, int(SCRIPT_BYTES // max(element_bytes, 1.0))))


def describe_dead_entry(raw: bytes) -> dict[str, Any]:
    """One dead-letter list element as ``dead list`` shows it; never raises."""
    if isinstance(raw, bytes):  # a dead malformed element may hold any bytes
        raw = raw.decode("utf-8", "surrogateescape")
    try:
        entry = json.loads(raw)
        headers, message = entry["headers"], entry["message"]
        reason, queue, at = headers[DEAD_REASON], headers[DEAD_QUEUE], headers.get(DEAD_AT)
    except (ValueError, TypeError, KeyError):
        return {"id": None, "task": None, "reason": "malformed dead-letter entry", "queue": None, "at": None}
    task_id = task = None
    inner, _ = decode_redis_element(message) if isinstance(message, str) else (None, None)
    if inner is not None and isinstance(inner.get("headers"), dict):
        task_id, task = inner["headers"].get("id"), inner["headers"].get("task")
    return {
        "id": task_id if isinstance(task_id, str) else None,
        "task": task if isinstance(task, str) else None,
        "reason": str(reason),
        "queue": str(queue),
        "at": at if isinstance(at, (int, float)) and not isinstance(at, bool) else None,
    }


#: How often, and how many at most per call, the oldest dead letters beyond ``prio_dead_letter_max`` go.
DEAD_CAP_INTERVAL = 5.0
DEAD_CAP_STEP = 10_000
#: Dead letters one requeue call looks at (the whole requeue is a series of such calls).
REQUEUE_CHUNK = 500
#: How often the fleet looks for messages of workers that are gone (prompt recovery; the beat itself
#: comes from a thread, ``redis_liveness``).
SWEEP_INTERVAL = 1.0
#: Owner records one sweep call reads (about 3 ms of Redis); a pass reads at most
#: ``SWEEP_CHUNKS_PER_PASS`` of them each second and the next pass goes on from the fleet's cursor.
SWEEP_BATCH = 1000
SWEEP_CHUNKS_PER_PASS = 50


def sweep_keys(settings: PrioSettings) -> list[str]:
    """The sweep's lock (one sweeper a second for the fleet) and its HSCAN cursor."""
    return [settings.owners_key + ".sweep", settings.owners_key + ".sweep_cursor"]


#: How often a worker reports its per-tier take rate (publishers' Retry-After).
RATE_INTERVAL = 2.0


class RedisFetchSource(FetchSource):
    """The worker's Redis side: one round trip per fetch, over every served list in order.

    One script takes the oldest message of the first non-empty list and
    records it unacked, atomically: an empty tier costs nothing extra, and the
    message is in kombu's unacked hash (so a dead worker's message is
    restored) from the instant it leaves its list. Elements that are not
    kombu messages are moved to the dead letters by the same script, with
    their reason; they never reach Celery.
    """

    def __init__(self, app: Any, channel: Any, served: ServedQueues, settings: PrioSettings, worker_name: str) -> None:
        from kombu.serialization import prepare_accept_content
        from kombu.transport import virtual

        super().__init__(served, settings)
        self.channel = channel
        self.worker_name = worker_name
        self.accept = prepare_accept_content(app.conf.accept_content)
        self.adapter = RedisAdapter(app, client=channel.client)
        self._script = channel.client.register_script(FETCH)
        self._beat = channel.client.register_script(HEARTBEAT)
        self._sweep = channel.client.register_script(SWEEP_DEAD_OWNERS)
        self.returned = 0  # messages of gone workers this worker returned to their queues
        self._dead_letter = channel.client.register_script(DEAD_LETTER)
        self._local_append = virtual.QoS.append  # kombu's in-process bookkeeping only
        self._rate_mark: tuple[float, dict[Tier, int]] | None = None
        self._registry: list[str] | None = None  # sub-queues, as of ``_registry_version``
        self._registry_version: Any = None

    #: One fetch script call asks every served list: serving more queues costs no round trip.
    asks_all_queues_in_one_call = True

    def keys_for(self, queue: str) -> list[str]:
        return [self.channel._q_for_pri(queue, pri) for pri in self.channel.priority_steps]

    def take(self, order: list[Tier]) -> Take:
        keys: list[str] = []
        owners: list[Candidate] = []
        for tier in order:
            for candidate in self.served.candidates(tier):
                for key in self.keys_for(candidate.name):
                    keys.append(key)
                    owners.append(candidate)
        self.broker_calls += 1
        hit = self.fetch(keys, [c.tier for c in owners])
        if hit is None:
            return Take(empty=tuple(order), empty_queues=tuple(dict.fromkeys(c.name for c in owners)))
        index, message = hit
        if message is None:
            return Take(dead_lettered=1)
        candidate = owners[index]
        message.accept = self.accept
        passed = tuple(dict.fromkeys(c.name for c in owners[:index] if c.name != candidate.name))
        return Take(candidate.tier, message, tuple(order[: order.index(candidate.tier)]), 0, candidate.name, passed)

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

    def _registry_moved(self, version: Any, found: bool) -> None:
        """A fetch saw the registry at ``version``: a new sub-queue is served from the next fetch on.

        When this fetch found nothing, the loop is woken to ask again at
        once, so a new sub-queue's first message waits for no poll interval.
        """
        if version == self._registry_version:
            return
        names = self.discover_subqueues()
        if names is not None and names != self.served.discovered:
            self.served.set_discovered(names)
            if not found:
                self.on_arrival()

    def fetch(self, keys: list[str], tiers: list[Tier]) -> tuple[int, Any] | None:
        """``(index into keys, kombu Message)`` for the first non-empty key, or None when all are empty.

        ``(index, None)`` means elements were dead-lettered and nothing is
        delivered yet: ask again. ``tiers[i]`` is the tier of ``keys[i]``.
        """
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
            ],
            args=[time.time(), *(t.label for t in tiers), self.worker_name],
            client=channel.client,
        )
        position, raw, version = int(reply[0]) - 1, reply[1], reply[2]
        self._registry_moved(version or None, found=position != -2)
        if position == -2:
            return None
        if position < 0:
            logger.error("celery-prio: moved %s malformed element(s) to %s", raw, self.settings.dead_letter_queue)
            return -1, None
        payload, problem = decode_redis_element(raw)
        message = None
        if problem is None:
            try:
                message = channel.Message(payload, channel=channel)
            except Exception as exc:  # e.g. a body that is not valid base64
                problem = f"malformed: kombu cannot read it ({exc!r})"
        if message is None:
            tag = _text(reply[3]) if len(reply) > 3 else _tag_of(raw)  # the script's: cjson read it
            self._dead_letter_raw(raw, problem or "malformed", tiers[position], keys[position], tag)
            return position, None
        message.prio_raw = raw  # dead-lettering later keeps the element exactly as it was
        message.prio_queue = keys[position]
        self._local_append(channel.qos, message, message.delivery_tag)
        return position, message

    def _dead_letter_raw(self, raw: Any, reason: str, tier: Tier, queue: str, tag: str) -> None:
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

    def dead_letter(self, message: Any, reason: str, tier: Tier) -> None:
        self._dead_letter_raw(message.prio_raw, reason, tier, getattr(message, "prio_queue", ""), "")

    # -- housekeeping on the worker's loop --------------------------------------
    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        jobs = [
            Job(SWEEP_INTERVAL, self._return_dead_owners_messages, "return the messages of workers that are gone"),
            Job(RATE_INTERVAL, lambda: self._report_rates(dispatched()), "report drain rates"),
            Job(RATE_INTERVAL, self._share_estimates, "share run-time estimates"),
            Job(PRUNE_INTERVAL, self._prune, "prune workers, estimates and sub-queues unheard of"),
        ]
        if self.settings.dead_letter_max is not None:
            jobs.append(Job(DEAD_CAP_INTERVAL, self._cap_dead_letters, "keep the dead letters under their cap"))
        if any(self.settings.aging[t] is not None for t in AGING_TIERS):
            # Every worker ages, whatever its -Q: offline ages into batch with no offline worker at all.
            jobs.append(Job(self.settings.aging_interval, self._age, "aging"))
        return jobs

    def recover_own(self, held: set[str]) -> int:
        """Owned by this incarnation but not in its hands: fetched on the connection that died, whose
        restore at close failed (Redis was down). A live owner's messages are never swept, so they would
        stay unacked for good; they go back through kombu's restore now (marked redelivered)."""
        client, mine, returned = self.channel.client, self.worker_name + "|", 0
        self._settle_unsettled()
        for tag, owner in client.hscan_iter(self.settings.owners_key, count=SWEEP_BATCH):
            tag = _text(tag)
            if _text(owner).startswith(mine) and tag not in held:
                self._restore_or_dead_letter(tag)
                returned += 1
        if returned:
            logger.warning("celery-prio: returned %d message(s) fetched before the reconnect to their queues", returned)
        return returned

    def _settle_unsettled(self) -> None:
        """Acks and rejects that failed while Redis was unreachable: done, so forgotten now, not returned."""
        if not UNSETTLED:
            return
        client, settled = self.channel.client, set(UNSETTLED)
        pipe = client.pipeline()
        for tag in settled:
            pipe.hdel(self.channel.unacked_key, tag).zrem(self.channel.unacked_index_key, tag)
            pipe.hdel(self.settings.owners_key, tag)
        pipe.execute()
        UNSETTLED.difference_update(settled)
        logger.info("celery-prio: settled %d message(s) whose ack failed while Redis was unreachable", len(settled))

    def fleet_serving(self) -> dict[Tier, int] | None:
        try:
            return self.adapter.serving(self.settings)
        except self.channel.connection_errors:
            return None

    def join_fleet(self) -> list[list[Any]]:
        self.heartbeat()  # before the first fetch: the messages it fetches have a live owner from the start
        # Then from a thread, on a connection of its own: a busy event loop (a task under the solo pool,
        # a long housekeeping pass) never makes this live worker look dead.
        beat_client = self.channel._create_client(asynchronous=False)
        PROCESS_HEARTBEAT.attach(lambda: self.heartbeat(beat_client))
        return []

    def heartbeat(self, client: Any = None) -> None:
        """Say this worker is alive and which tiers it serves (before its first fetch, then every second)."""
        tiers = ",".join(t.label for t in self.served.tiers)
        self._beat(
            keys=[self.settings.heartbeats_key, self.settings.serving_key],
            args=[self.worker_name, tiers],
            client=client or self.channel.client,
        )

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
        from); the sweep script hands each one to a single sweeper.
        """
        channel, settings = self.channel, self.settings
        limits: list[Any] = []
        for tier, seconds in settings.redeliver_after.items():
            limits += [tier.label, seconds]
        returned = 0
        try:
            self._settle_unsettled()  # an ack that failed without a reconnect (a timeout) is settled here
            for _ in range(SWEEP_CHUNKS_PER_PASS):  # chunk by chunk: Redis serves others in between
                reply = self._sweep(
                    keys=[settings.owners_key, settings.heartbeats_key, *sweep_keys(settings)],
                    args=[self.worker_name, SWEEP_BATCH, *limits],
                    client=channel.client,
                )
                if not reply:  # another worker sweeps this second
                    break
                for tag in reply[1:]:
                    self._restore_or_dead_letter(_text(tag))
                returned += len(reply) - 1
                if _text(reply[0]) == "0":  # the pass reached the end of the hash
                    break
        except channel.connection_errors:
            pass  # what this sweep took but did not restore is taken again after 10 s (by any worker)
        if returned:
            logger.warning("celery-prio: returned %d message(s) of workers that are gone to their queues", returned)
            self.returned += returned

    def _restore_or_dead_letter(self, tag: str) -> None:
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
        key = self.settings.queue_prefix + ".estimates"
        states = [(name, state) for _, name, state in self.served.queue_states()]
        mine = {name: f"{state.estimate:.6f}" for name, state in states if state.measured}
        client = self.channel.client
        if mine:
            client.hset(key, mapping=mine)
            mention(client, self.settings, "estimates", list(mine))
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
        wall = time.time()
        mapping = {
            f"{self.worker_name}|{tier.label}": f"{(counts[tier] - last[tier]) / (now - last_at):.4f} {wall:.3f}"
            for tier in TIERS
        }
        self.channel.client.hset(f"{self.settings.stats_key}.rates", mapping=mapping)

    def _age(self) -> None:
        now = time.time()
        subqueues = self.discover_subqueues() or []
        for tier in AGING_TIERS:  # batch -> realtime first, so offline -> batch finds room
            self.adapter.promote_aged(self.settings, tier, now)
            for name in subqueues:  # one pass per sub-queue: every worker ages, whatever its -Q
                if self.settings.subqueue_of(name, tier) is not None:
                    self.adapter.promote_aged(self.settings, tier, now, source=name)

    def broker_figures(self, now: float) -> BrokerFigures:
        wall = time.time()
        oldest = {t: self.adapter.oldest_age(self.settings.queue_name(t), wall) for t in TIERS}
        return BrokerFigures(
            counters=self.adapter.counters(self.settings),
            oldest_age=oldest,
            depth=self.served_depths(),
            read_at=now,
            dead_letters=self.dead_letter_depth(),
        )

    def queue_depths(self, names: list[str]) -> list[int]:
        pipe = self.channel.client.pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
        return [int(n) for n in pipe.execute()]


#: The end of an unacked entry as the fetch script (``[raw,"",queue]``) or kombu (``[raw, "", queue]``) writes it.
_ENTRY_TAIL = re.compile(rb',\s*"(?:[^"\\]|\\.)*",\s*"((?:[^"\\]|\\.)*)"\]\s*$')


def split_unacked_entry(entry: bytes) -> tuple[bytes, str]:
    """``(raw message, queue)`` of a kombu unacked entry, without decoding the message (it may not decode)."""
    match = _ENTRY_TAIL.search(entry)
    if not entry.startswith(b"[") or match is None:
        return entry, ""
    return entry[1 : match.start()], match.group(1).decode(errors="replace")


def _tag_of(raw: Any) -> str:
    try:
        tag = json.loads(raw)["properties"]["delivery_tag"]
    except Exception:
        return ""
    return tag if isinstance(tag, str) else ""
