"""RabbitMQ: a message that cannot go to Celery is moved to the dead-letter queue, with why and where from."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import amqp

from ...headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, DEAD_TIER
from ...settings import PrioSettings
from ...tiers import Tier

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel

logger = logging.getLogger(__name__)


def publish_dead(
    channel: AmqpChannel,
    settings: PrioSettings,
    body: bytes,
    properties: dict[str, object],
    reason: str,
    queue: str,
    tier: Tier | None,
) -> None:
    """A copy of the message in ``settings.dead_letter_queue``, confirmed before the caller settles the original:
    never lost, at worst copied twice."""
    logger.error("celery-prio: message from %s moved to %s: %s", queue, settings.dead_letter_queue, reason)
    props = dict(properties or {})
    headers = props.get("application_headers")
    headers = dict(headers) if isinstance(headers, dict) else {}
    headers.update({DEAD_REASON: reason, DEAD_QUEUE: queue, DEAD_AT: time.time()})
    if tier is not None:
        headers[DEAD_TIER] = tier.label
    props.update(application_headers=headers, delivery_mode=2)
    channel.basic_publish_confirm(amqp.Message(body, **props), exchange="", routing_key=settings.dead_letter_queue)
