"""The naming scheme: every queue and broker key celery-prio uses, built from ``prio_queue_prefix``.

A mixin of :class:`~celery_prio.settings.PrioSettings`, so code that holds the
settings asks them for names (``settings.queue_name(tier)``); kept apart
from parsing and validation, which never need it.
"""

from __future__ import annotations

import re
import zlib

from ..headers import PROMOTED_SUFFIX, READY_INDEX
from ..tiers import TIERS, Tier

SUBQUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RESERVED_SUBQUEUES = ("promoted", "dlx")
#: Sub-queues of one task name (realtime's shortest-first queues, batched tasks' queues) start with this.
TASK_SUBQUEUE_PREFIX = "sjf-"


def subqueue_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a sub-queue, or None."""
    if not isinstance(name, str) or not SUBQUEUE_NAME.fullmatch(name):
        return f"sub-queue name {name!r} must be 1-64 letters, digits, '_' or '-', starting with a letter or digit"
    if name in RESERVED_SUBQUEUES:
        return f"sub-queue name {name!r} is reserved ({', '.join(RESERVED_SUBQUEUES)})"
    return None


class QueueNames:
    """Names of queues and keys under one prefix (``queue_prefix`` comes from the settings)."""

    queue_prefix: str

    def queue_name(self, tier: Tier) -> str:
        return f"{self.queue_prefix}.{tier.label}"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.queue_prefix}.dead"

    @property
    def subqueue_registry(self) -> str:
        """Redis set of every sub-queue published to (workers discover sub-queues from it)."""
        return f"{self.queue_prefix}.subqueues"

    @property
    def subqueue_registry_version(self) -> str:
        """Redis counter bumped whenever a name joins the registry (the fetch script returns it)."""
        return f"{self.subqueue_registry}.version"

    @property
    def task_directory(self) -> str:
        """Redis set of every task name a worker of the fleet registered (apps sharing a broker)."""
        return f"{self.queue_prefix}.tasks"

    @property
    def serving_key(self) -> str:
        """Redis hash: worker -> the tiers it serves (beside its heartbeat: a queue nobody serves is seen)."""
        return f"{self.queue_prefix}.serving"

    def presence_queue(self, tier: Tier) -> str:
        """RabbitMQ: the queue whose consumers are the workers serving ``tier`` (it never holds a message)."""
        return f"{self.queue_prefix}.serving.{tier.label}"

    def bell_key(self, tier: Tier) -> str:
        """Redis list: the tier's doorbell, rung by every publish into it; idle workers block on it (BLPOP)."""
        return f"{self.queue_prefix}.bell.{tier.label}"

    @property
    def housekeeper_key(self) -> str:
        """The fleet's housekeeper lease (Redis: a key set with ``PX``; RabbitMQ: a queue holding one token)."""
        return f"{self.queue_prefix}.housekeeper"

    @property
    def ready_key(self) -> str:
        """Redis sorted set: the tier lists, front lanes and sub-queue lists that may hold work
        (``lua/mark_ready.lua``)."""
        return f"{self.queue_prefix}.{READY_INDEX}"

    def is_indexed(self, queue: str) -> bool:
        """A tier queue, front lane or sub-queue: only celery-prio's scripts push to its lists, so a fetch asks
        it only while the ready index holds it (Redis). Other queues (the app's own, legacy) are always asked."""
        return any(queue == (name := self.queue_name(t)) or queue.startswith(name + ".") for t in TIERS)

    @property
    def owners_key(self) -> str:
        """Redis hash: delivery tag -> the worker that fetched it (``worker|tier|fetched at``)."""
        return f"{self.queue_prefix}.owners"

    @property
    def heartbeats_key(self) -> str:
        """Redis hash: worker -> when it last said it is alive (Redis time)."""
        return f"{self.queue_prefix}.heartbeats"

    @property
    def slots_key(self) -> str:
        """Redis hash: worker -> its concurrency (written with the tiers it serves)."""
        return f"{self.queue_prefix}.slots"

    @property
    def admission_key(self) -> str:
        """Redis hash: ``slots:<tier>`` -> the live slots serving the tier (the housekeeper's sum, short-lived):
        the publish script divides the work waiting in a tier by it to predict a new call's wait."""
        return f"{self.queue_prefix}.admission"

    @property
    def estimates_key(self) -> str:
        """Redis hash: queue -> the fleet's run-time estimate of its tasks (seconds)."""
        return f"{self.queue_prefix}.estimates"

    @property
    def stats_key(self) -> str:
        """Redis hash of broker-side counters (rejected/dropped per tier)."""
        return f"{self.queue_prefix}.stats"

    def tier_for_queue(self, name: str) -> Tier | None:
        """The tier a queue belongs to: a tier queue, its ``.promoted`` front lane, or one of its sub-queues."""
        name = name.removesuffix(PROMOTED_SUFFIX)
        for tier in TIERS:
            if name == self.queue_name(tier) or self.subqueue_of(name, tier) is not None:
                return tier
        return None

    def subqueue_name(self, tier: Tier, subqueue: str) -> str:
        return f"{self.queue_name(tier)}.{subqueue}"

    def is_subqueue(self, queue: object) -> bool:
        """Whether ``queue`` names a sub-queue of one of this app's tiers (``<prefix>.<tier>.<name>``)."""
        if not isinstance(queue, str):
            return False
        tier = self.tier_for_queue(queue)
        return tier is not None and self.subqueue_of(queue, tier) is not None

    def subqueue_of(self, queue: str, tier: Tier) -> str | None:
        """The sub-queue ``queue`` is in ``tier`` (``<prefix>.<tier>.<name>``), or None."""
        head = self.queue_name(tier) + "."
        if not queue.startswith(head):
            return None
        name = queue[len(head) :]
        return None if subqueue_name_problem(name) else name

    def sjf_subqueue(self, task_name: str) -> str:
        """The realtime sub-queue of a task name under shortest-job-first (``sjf-<name>``, a valid queue name)."""
        name = TASK_SUBQUEUE_PREFIX + re.sub(r"[^A-Za-z0-9_-]", "-", task_name)
        if len(name) > 64:  # long names: a prefix and a checksum of the whole
            name = f"{name[:55]}-{zlib.crc32(task_name.encode()):08x}"
        return name

    def sjf_queue(self, task_name: str) -> str:
        """The broker queue of a task name's shortest-first sub-queue."""
        return self.subqueue_name(Tier.REALTIME, self.sjf_subqueue(task_name))
