"""Every broker-side step is bounded (issue 26): one Redis script call reads a bounded number of
entries and bytes, so a long list, a lowered cap or huge messages never hold Redis for long.

Real Redis, the scripts the library ships, called the way the library calls them.
"""

from __future__ import annotations

import json
import time

from celery_prio.brokers.redis.boost import RedisBooster
from celery_prio.brokers.redis.scripts import BOOST_FIND, EVICT_BUDGET, GUARDED_PUSH, SCRIPT_BYTES
from celery_prio.tiers import Tier
from tests.test_untrusted import ids_in, message

B, O = Tier.BATCH, Tier.OFFLINE


def dead_entry(queue: str, msg: bytes) -> str:
    return json.dumps({"headers": {"prio_dead_queue": queue, "prio_dead_reason": "r"}, "message": msg.decode()})


def test_a_long_requeue_goes_in_bounded_calls_and_moves_everything_once(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    client.lpush(s.dead_letter_queue, *[dead_entry(env.queue(O), message(1.0, f"m{i}")) for i in range(1_234)])
    client.lpush(s.dead_letter_queue, "not json")  # skipped, kept, looked at once
    assert adapter.dead_requeue(s, 700) == (700, 535, 0)
    assert adapter.dead_requeue(s) == (534, 1, 1)  # the rest, in calls of 500; the bad one stays
    assert ids_in(client, env.queue(O)) == [f"m{i}" for i in range(1_234)]  # oldest first, each once


def test_lowering_a_cap_evicts_a_bounded_number_per_publish(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    queue = env.queue(B)
    client.lpush(queue, *[message(1.0, f"m{i}") for i in range(2_500)])
    push = client.register_script(GUARDED_PUSH)
    keys = [queue, s.dead_letter_queue, s.stats_key]
    for expected_depth in (1_501, 502, 10):  # each publish evicts at most EVICT_BUDGET; the excess goes over a few
        push(keys=keys, args=[message(1.0, "new"), 10, "drop_oldest", "batch", time.time()])
        assert client.llen(queue) == expected_depth
    assert client.llen(s.dead_letter_queue) == 2_500 + 3 - 10  # every evicted one kept, nothing lost
    assert EVICT_BUDGET == 1_000


def test_a_boost_look_reads_a_bounded_number_of_bytes_and_still_finds_the_oldest(redis_parts):
    env, _, adapter, _ = redis_parts
    client = adapter.client
    queue = env.queue(O)
    padding = "x" * 500_000  # 500 KB messages: 30 of them are 15 MB
    client.lpush(queue, message(1.0, "target", pad=padding))
    client.lpush(queue, *[message(1.0, f"m{i}", pad=padding) for i in range(29)])
    find = client.register_script(BOOST_FIND)
    first = find(keys=[queue], args=["target", 10_000, 1, 0])
    assert int(first[0]) == 0 and 0 < int(first[2]) <= SCRIPT_BYTES // 500_000 + 1  # stopped on bytes
    hit = RedisBooster(None, None).find(client, "target", [queue])
    assert hit is not None and hit[0] == queue and b"target" in hit[1]


def test_a_fetch_dead_letters_a_bounded_number_of_bytes_of_garbage_per_call(redis_parts):
    env, s, adapter, fetcher = redis_parts
    client = adapter.client
    queue = env.queue(B)
    client.lpush(queue, *[b"garbage " * 262_144] * 5)  # 2 MB each, none a kombu envelope (the oldest end)
    client.lpush(queue, message(1.0, "good"))
    replies = []
    while (hit := fetcher.fetch([queue], [B], full=True)) is not None and hit[1] is None:  # raw writes: no index
        replies.append(hit)
    assert len(replies) >= 2  # 10 MB of garbage is moved aside over several calls, not one
    assert hit is not None and hit[1].headers["id"] == "good"
    hit[1].ack()
    assert client.llen(s.dead_letter_queue) == 5


def test_an_aging_look_reads_a_bounded_number_of_bytes_and_still_promotes_everything_due(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    queue = env.queue(B)
    client.lpush(queue, *[message(1.0, f"big{i}", pad="x" * 1_000_000) for i in range(20)])  # 1 MB each, aged
    assert adapter.promote_aged(s, B, time.time()) == 20  # all due, promoted in one pass ...
    assert adapter.aging._aging_window[queue] == 4  # ... four at a time: about SCRIPT_BYTES (4 MB) a look
    assert ids_in(client, env.queue(Tier.REALTIME) + ".promoted") == [f"big{i}" for i in range(20)]
