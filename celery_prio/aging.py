"""Aging: a task that waited past its tier's threshold moves one tier up.

Waiting counts from the enqueue stamp the router adds (``prio_enqueued_at``);
a message published without ``install()`` carries none and counts from when
an ager first sees it (it gets stamped then). A promoted message keeps its
original stamp and lists the tiers it left in ``prio_promoted_from``.

How it stays lossless, per broker:

* **Redis** — every worker of the app runs a pass each ``prio_aging_interval``
  seconds, whatever its ``-Q``. A pass reads the oldest end of a tier list,
  decides here (pure code, below) which messages are due, and hands them to
  an atomic Lua script that moves each one only if it is still the oldest
  element it saw. Concurrent agers therefore never move one message twice,
  and a worker killed mid-pass leaves each message either moved or not
  moved. The cost is proportional to the number promoted, not queue length.
* **RabbitMQ** — the broker itself ages: each tier queue has
  ``x-message-ttl`` = its threshold and a dead-letter headers exchange that
  sends expired messages to the tier above (``brokers/amqp``). No worker
  needs to run, nothing is held unacked, nothing can run twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .routing import ENQUEUED_HEADER, PROMOTED_HEADER
from .tiers import Tier


@dataclass
class PromotionPlan:
    """What one look at a tier's oldest messages decided."""

    originals: list[bytes] = field(default_factory=list)  # due, oldest first, as stored
    rewritten: list[str] = field(default_factory=list)  # the same, re-addressed to the upper tier
    stamp: tuple[int, bytes, str] | None = None  # (index from the oldest end, original, stamped)


def plan_promotions(
    oldest_first: list[bytes], tier: Tier, upper_queue: str, threshold: float, now: float
) -> PromotionPlan:
    """Pure: which of a tier's oldest messages are due for promotion.

    Only a run of due messages at the oldest end moves: the first message
    that is not due yet ends the plan, so a pass never reaches deeper than
    the messages it promotes. An unstamped message ends it too, and gets
    stamped with ``now`` (its wait starts when celery-prio first sees it).
    """
    plan = PromotionPlan()
    for index, raw in enumerate(oldest_first):
        try:
            message = json.loads(raw)
            headers = message.setdefault("headers", {})
        except (ValueError, AttributeError):
            break  # not a kombu message: leave it for the worker to reject
        stamp = headers.get(ENQUEUED_HEADER)
        if not isinstance(stamp, (int, float)):
            headers[ENQUEUED_HEADER] = now
            plan.stamp = (index, raw, json.dumps(message))
            break
        if now - stamp < threshold:
            break
        headers[PROMOTED_HEADER] = [*headers.get(PROMOTED_HEADER, []), tier.label]
        delivery = message.setdefault("properties", {}).setdefault("delivery_info", {})
        # A later restore (worker died holding it) must go to the new queue.
        delivery["exchange"] = upper_queue
        delivery["routing_key"] = upper_queue
        plan.originals.append(raw)
        plan.rewritten.append(json.dumps(message))
    return plan


def enqueue_age(headers: dict | None, now: float) -> float | None:
    """Seconds since a message was first enqueued, from its stamp (None if unstamped)."""
    stamp = (headers or {}).get(ENQUEUED_HEADER)
    return now - stamp if isinstance(stamp, (int, float)) else None
