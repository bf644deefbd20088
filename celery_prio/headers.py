"""Names celery-prio writes into messages and broker keys. A leaf module: imports nothing of ours."""

from __future__ import annotations

#: Wall-clock time (epoch seconds) a message was first published. Queue wait
#: and aging are measured from it; aging keeps it.
ENQUEUED_HEADER = "prio_enqueued_at"
#: The tiers a message was promoted from, oldest first.
PROMOTED_HEADER = "prio_promoted_from"

#: Dead-letter annotations (Redis: in the envelope around the untouched
#: message; RabbitMQ: headers of the re-published copy).
DEAD_REASON = "prio_dead_reason"
DEAD_QUEUE = "prio_dead_queue"
DEAD_TIER = "prio_dead_tier"
DEAD_AT = "prio_dead_at"

#: Suffix of the queue that takes messages promoted *into* a tier; workers
#: serving the tier take from it first, oldest first.
PROMOTED_SUFFIX = ".promoted"
