"""Aging: a task that waited past its tier's threshold moves one tier up.

Waiting counts from the enqueue stamp the router adds (``prio_enqueued_at``).
A message without a usable stamp (published without ``install()``, or by a
producer that wrote ``NaN``, ``true``, a string, or a time in the future)
counts from when an ager first sees it: it is (re)stamped then. A promoted
message keeps its original stamp and lists the tiers it left in
``prio_promoted_from``.

How it stays lossless, per broker:

* **Redis** — every worker of the app runs a pass each ``prio_aging_interval``
  seconds, whatever its ``-Q``. A pass reads the oldest end of a tier list,
  decides here (pure code, below) which messages are due, and hands them to
  an atomic Lua script that moves each one only if it is still the oldest
  element it saw, into the upper tier's ``.promoted`` list (served first by
  that tier's workers, oldest first). Concurrent agers therefore never move
  one message twice, and a worker killed mid-pass leaves each message either
  moved or not moved. The cost is proportional to the number promoted, not
  to the queue length. An element at the oldest end that is not a message
  at all is moved to the dead letters with its reason, so it cannot stop
  aging of the messages behind it.
* **RabbitMQ** — the broker itself ages: each tier queue has
  ``x-message-ttl`` = its threshold and a dead-letter headers exchange that
  sends expired messages to the tier above (``brokers/amqp``). No worker
  needs to run, nothing is held unacked, nothing can run twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..headers import ENQUEUED_HEADER, PROMOTED_HEADER
from ..tiers import Tier
from ..untrusted import decode_redis_element, valid_stamp


@dataclass
class PromotionPlan:
    """What one look at a window of a tier's oldest messages decided."""

    originals: list[bytes] = field(default_factory=list)  # due, oldest first, as stored
    rewritten: list[str] = field(default_factory=list)  # the same, re-addressed to the upper tier
    #: (index from the oldest end, original, stamped) for every message whose stamp is missing or unusable
    stamps: list[tuple[int, bytes, str]] = field(default_factory=list)
    #: (original, reason) for the run of elements at the oldest end that are not messages: dead letters
    dead_heads: list[tuple[bytes, str]] = field(default_factory=list)


_STAMP_KEY = f'"{ENQUEUED_HEADER}": '


def _looks_stamped(raw: bytes | str) -> bool:
    """Cheap: the element carries an enqueue stamp key (its value is checked once it reaches the head)."""
    if isinstance(raw, bytes):
        return _STAMP_KEY.encode() in raw
    return _STAMP_KEY in raw


def plan_promotions(
    oldest_first: list[bytes],
    tier: Tier,
    upper_queue: str,
    threshold: float,
    now: float,
    *,
    offset: int = 0,
) -> PromotionPlan:
    """Pure: which of a tier's oldest messages are due, and which need a stamp.

    ``oldest_first`` is a window of the list starting ``offset`` elements from
    the oldest end. Only a run of due messages at the very oldest end
    (``offset == 0``) moves: the first message that is not due ends it, so a
    pass never promotes past a message that waited less. Every message of the
    window without a usable stamp is stamped with ``now`` (one script call),
    whether or not the run reached it, so a backlog published without stamps
    starts its wait at once instead of one message per threshold.
    """
    plan = PromotionPlan()
    running = offset == 0
    for index, raw in enumerate(oldest_first):
        if not running and not plan.dead_heads and _looks_stamped(raw):
            continue  # past the due run only unstamped messages matter; a substring test is ~100x a parse
        message, problem = decode_redis_element(raw)
        if message is None or problem is not None:
            problem = problem or "malformed: not a message"
            if offset == 0 and len(plan.dead_heads) == index:
                plan.dead_heads.append((raw, problem))
                continue  # still at the oldest end: the pass moves it aside
            running = False  # the fetch (or a later pass, once it is the head) dead-letters it
            continue
        if plan.dead_heads:
            return plan  # the pass moves the garbage aside, then looks again
        headers = message.get("headers")
        if not isinstance(headers, dict):
            headers = message["headers"] = {}
        stamp = valid_stamp(headers.get(ENQUEUED_HEADER))
        if stamp is None or stamp > now:
            headers[ENQUEUED_HEADER] = now
            plan.stamps.append((offset + index, raw, json.dumps(message)))
            running = False
            continue
        if not running or now - stamp < threshold:
            running = False
            continue
        readdress(message, tier, upper_queue, PROMOTED_HEADER)
        plan.originals.append(raw)
        plan.rewritten.append(json.dumps(message))
    return plan


def readdress(message: dict[str, Any], from_tier: Tier, queue: str, history_header: str) -> dict[str, Any]:
    """Rewrite a decoded Redis envelope, in place, for a move to ``queue`` (aging, boost).

    ``history_header`` gets ``from_tier`` appended; ``delivery_info`` is
    addressed to ``queue`` itself (anonymous exchange), or a later restore
    would send the message back where it came from.
    """
    headers = message.get("headers")
    if not isinstance(headers, dict):
        headers = message["headers"] = {}
    history = headers.get(history_header)
    headers[history_header] = [*(history if isinstance(history, list) else []), from_tier.label]
    props = message["properties"]
    info = props.get("delivery_info")
    props["delivery_info"] = {**(info if isinstance(info, Mapping) else {}), "exchange": "", "routing_key": queue}
    return message
