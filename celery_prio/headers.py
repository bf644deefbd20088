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

#: Redis: the ready index's name after ``<prefix>.``: a sorted set of the lists that may hold work. Not
#: ``ready``: that was a plain set in builds before the scores, and a script that sends a sorted-set
#: command to it fails with WRONGTYPE, so a fleet (or a Redis) those builds left an index in would fail
#: every publish; under this name the old set is never touched (the housekeeper's round finds their lists).
READY_INDEX = "ready-index"

#: On the continuation of a sliced task: ``{"gen": n, "enqueued_at": t}``:
#: the n-th resumption, and when the first run was published (waits and aging
#: count from there).
SLICE_HEADER = "prio_slice"
#: Redis: the key recording how many continuations of a task id were
#: committed (``<prefix>.slice.<id>``); a copy of an earlier generation is stale and is acked unrun.
SLICE_MARKER_SUFFIX = ".slice."
#: RabbitMQ: a record of the slices journal (``<prefix>.slices``): the task id and the generation committed.
SLICE_ID = "slice"
SLICE_GENERATION = "gen"

#: The tiers a task was lifted from by ``celery_prio.boost`` (priority inheritance at run time), oldest first.
BOOSTED_HEADER = "prio_boosted_from"
#: On a lifted copy published by a RabbitMQ boost: ``{"gen": n}``. A worker that was told about
#: generation n of a task id acks every copy of an earlier generation unrun (the stale original).
BOOST_GENERATION_HEADER = "prio_boost"
