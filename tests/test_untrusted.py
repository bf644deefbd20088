"""Anything on a tier list: the pure checks, aging, stats and a fuzz run against real Redis.

The fuzz test feeds random elements (bytes, JSON of any shape, envelopes with
random headers, stamps and properties) through the real fetch script, aging
passes, stats readers and dead-letter tools, against real Redis, and checks
that no exception escapes and that every element is accounted for: run,
dead-lettered, or still queued.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_prio.brokers.redis.admin import describe_dead_entry
from celery_prio.brokers.redis.transport import drain_rate
from celery_prio.headers import ENQUEUED_HEADER
from celery_prio.tiers import TIERS, Tier
from celery_prio.untrusted import enqueue_age, headers_problem, redis_envelope_problem, valid_stamp

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


# -- pure ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [(1.5, 1.5), (3, 3.0), (True, None), (float("nan"), None), (float("inf"), None), ("1", None), (None, None)],
)
def test_valid_stamp(value, expected):
    assert valid_stamp(value) == expected


def test_enqueue_age_never_raises_and_counts_a_future_stamp_as_now():
    assert enqueue_age({ENQUEUED_HEADER: 90.0}, 100.0) == 10.0
    assert enqueue_age({ENQUEUED_HEADER: 500.0}, 100.0) == 0.0
    for headers in ([1], "x", None, {ENQUEUED_HEADER: float("nan")}, {ENQUEUED_HEADER: True}):
        assert enqueue_age(headers, 100.0) is None


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ([1, 2], "envelope is not an object"),
        ({}, "no 'properties' object"),
        ({"properties": {"delivery_tag": 5}}, "delivery_tag missing or not a string"),
        ({"properties": {"delivery_tag": "t"}, "headers": "x"}, "headers are not an object"),
        ({"properties": {"delivery_tag": "t"}, "headers": {"task": 1}}, "header 'task' is a int"),
        ({"properties": {"delivery_tag": "t", "delivery_info": []}}, "delivery_info is not an object"),
        ({"properties": {"delivery_tag": "t"}, "body": 7}, "'body' is not a string"),
    ],
)
def test_envelope_problems_are_named(payload, problem):
    assert problem in redis_envelope_problem(payload)


def test_a_kombu_envelope_has_no_problem():
    assert (
        redis_envelope_problem({"body": "", "headers": {"task": "t", "id": "i"}, "properties": {"delivery_tag": "x"}})
        is None
    )
    assert headers_problem(None) is None


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"[]", b"{}", b'{"headers": 1, "message": 2}', b'{"headers": {}}'])
def test_dead_list_describes_a_malformed_dead_entry(raw):
    assert describe_dead_entry(raw)["reason"] == "malformed dead-letter entry"


# -- real Redis, in process (the redis_parts fixture is in conftest.py) -----------
def message(stamp=None, task_id=None, **headers) -> bytes:
    h = {"id": task_id or str(uuid.uuid4()), "task": "t.noop", **headers}
    if stamp is not None:
        h[ENQUEUED_HEADER] = stamp
    return json.dumps(
        {
            "body": "W1tdLCB7fSwge31d",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": h,
            "properties": {"delivery_tag": str(uuid.uuid4()), "body_encoding": "base64", "delivery_info": {}},
        }
    ).encode()


def ids_in(client, key) -> list[str]:
    return [json.loads(x)["headers"]["id"] for x in client.lrange(key, 0, -1)[::-1]]  # oldest first


def test_a_future_or_infinite_stamp_at_the_head_does_not_block_aging(redis_parts):
    env, s, adapter, _ = redis_parts
    now = time.time()
    client = adapter.client
    for head in (now + 10**6, float("inf")):
        client.delete(env.queue(O), env.queue(B) + ".promoted")
        raw = json.loads(message(task_id="head"))
        raw["headers"][ENQUEUED_HEADER] = head
        client.lpush(env.queue(O), json.dumps(raw).encode(), *(message(now - 120, f"due{i}") for i in range(5)))
        # (LPUSH of several: the head is pushed first, so it is the oldest.)
        adapter.promote_aged(s, O, now)
        # The head restarts its wait now; the five behind it are due and wait for it.
        assert enqueue_age(json.loads(client.lindex(env.queue(O), -1))["headers"], now) == 0.0
        adapter.promote_aged(s, O, now + 61)  # a threshold later: all six are due
        assert ids_in(client, env.queue(B) + ".promoted") == ["head", *(f"due{i}" for i in range(5))]


def test_a_garbage_head_is_dead_lettered_and_aging_goes_on(redis_parts):
    env, s, adapter, _ = redis_parts
    now = time.time()
    adapter.client.lpush(env.queue(O), b"[1, 2, 3]", *(message(now - 120, f"due{i}") for i in range(5)))
    assert adapter.promote_aged(s, O, now) == 5
    dead = adapter.dead_list(s)
    assert [d["reason"] for d in dead] == ["malformed: envelope is not an object"]
    assert dead[0]["queue"] == env.queue(O)


def test_an_unstamped_backlog_starts_waiting_at_once_not_one_message_per_threshold(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    client.lpush(env.queue(O), *(message(None, f"u{i}") for i in range(1000)))
    now = time.time()
    passes = 0
    while any(
        ENQUEUED_HEADER not in json.loads(x)["headers"] for x in client.lrange(env.queue(O), 0, -1)
    ):  # every pass stamps the head window, or one more window behind it
        adapter.promote_aged(s, O, now)
        passes += 1
        assert passes <= 12
    assert adapter.promote_aged(s, O, now + 61) == 1000  # all due one threshold later
    assert ids_in(client, env.queue(B) + ".promoted") == [f"u{i}" for i in range(1000)]


def test_promoted_messages_are_served_oldest_first_across_passes(redis_parts):
    env, s, adapter, fetcher = redis_parts
    client = adapter.client
    now = time.time()
    client.lpush(env.queue(O), *(message(now - 1000 + i, f"m{i}") for i in range(250)))
    assert adapter.promote_aged(s, O, now, batch=100) == 250  # three windows
    order = []
    keys = [env.queue(B) + ".promoted"]
    while (hit := fetcher.fetch(keys, [B])) is not None:
        order.append(hit[1].headers["id"])
        hit[1].ack()
    assert order == [f"m{i}" for i in range(250)]


def test_dead_requeue_only_addresses_this_apps_tier_queues_and_loses_nothing(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    dead = s.dead_letter_queue

    def entry(queue, msg=b"x"):
        return json.dumps(
            {"headers": {"prio_dead_queue": queue, "prio_dead_reason": "drop_oldest"}, "message": msg.decode()}
        )

    client.hset(f"{env.prefix}.ahash", "k", "v")
    crafted = [
        entry(f"{env.prefix}.elsewhere"),  # a list that is not a tier queue
        entry(f"{env.prefix}.ahash"),  # not even a list
        "not json",
        json.dumps([1, 2]),
        entry(env.queue(O), message(1.0, "good")),
    ]
    client.lpush(dead, *crafted)
    moved, left, skipped = adapter.dead_requeue(s)
    assert (moved, left, skipped) == (1, 4, 4)
    assert ids_in(client, env.queue(O)) == ["good"]
    assert client.llen(f"{env.prefix}.elsewhere") == 0 and client.hget(f"{env.prefix}.ahash", "k") == b"v"
    assert sorted(client.lrange(dead, 0, -1)) == sorted(x.encode() for x in crafted[:4])  # kept, as they were
    assert [d["reason"] for d in adapter.dead_list(s)].count("malformed dead-letter entry") == 2
    client.delete(f"{env.prefix}.ahash", f"{env.prefix}.elsewhere")


def test_dead_requeue_takes_sub_queues_back_too_and_nothing_that_only_looks_like_one(redis_parts):
    """Realtime traffic goes to shortest-first sub-queues by default: their dead letters must go back there."""
    env, s, adapter, _ = redis_parts
    client = adapter.client

    def entry(queue, msg):
        return json.dumps({"headers": {"prio_dead_queue": queue, "prio_dead_reason": "r"}, "message": msg.decode()})

    sjf, tenant = s.sjf_queue("t.add"), s.subqueue_name(B, "acme")
    crafted = [
        entry(sjf, message(1.0, "rt")),
        entry(tenant, message(1.0, "tenant")),
        entry(f"{env.prefix}.realtime.bad/name", message(1.0, "bad")),  # not a sub-queue name
        entry(f"{env.prefix}.realtime.{'x' * 65}", message(1.0, "long")),
        entry(f"{env.prefix}.realtime.dlx", message(1.0, "reserved")),
        entry("other.realtime.sjf-t-add", message(1.0, "other-app")),
    ]
    client.lpush(s.dead_letter_queue, *crafted)
    assert adapter.dead_requeue(s) == (2, 4, 4)
    assert ids_in(client, sjf) == ["rt"] and ids_in(client, tenant) == ["tenant"]
    client.delete(sjf, tenant)


def test_stats_readers_survive_garbage_in_the_stats_hashes(redis_parts):
    env, s, adapter, _ = redis_parts
    client = adapter.client
    client.hset(s.stats_key, mapping={"rejected:batch": "lots", "dropped:batch": 3})
    client.hset(
        f"{s.stats_key}.rates", mapping={"w|batch": "fast", "w2|batch": "1.0", "w3|batch": f"2.0 {time.time()}"}
    )
    assert adapter.counters(s) == {"dropped:batch": 3}
    assert drain_rate(client, s.stats_key, "batch") == 2.0
    client.lpush(env.queue(B), b"[1]")
    assert adapter.oldest_age(env.queue(B), time.time()) is None


# -- the fuzz run ----------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
stamps = st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=4) | st.just(time.time() - 3600)
headers = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"task": st.sampled_from(["t.noop", "t.nope"]) | json_values, "id": st.text(max_size=6) | json_values},
        optional={ENQUEUED_HEADER: stamps, "x-death": json_values, "prio_promoted_from": json_values},
    ),
)
envelopes = st.fixed_dictionaries(
    {},
    optional={
        "body": st.sampled_from(["W1tdLCB7fSwge31d", "!!", ""]) | json_values,
        "headers": headers,
        "properties": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {"delivery_tag": st.uuids().map(str) | json_values},
                optional={"body_encoding": st.sampled_from(["base64"]) | json_values, "delivery_info": json_values},
            ),
        ),
        "content-type": st.sampled_from(["application/json"]) | json_values,
    },
)


def _json(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _deep(depth: int) -> bytes:
    """A kombu envelope carrying a field nested ``depth`` levels: Redis' cjson reads up to 1,000, Python ~996."""
    return message(1.0, None, deep="__DEEP__").replace(b'"__DEEP__"', b"[" * depth + b"]" * depth)


#: Rare big elements (a few hundred KB): a 600 KB envelope, 600 KB of garbage.
huge = st.sampled_from([message(1.0, None, pad="x" * 600_000), b"\xff" * 600_000])
elements = st.one_of(
    st.binary(max_size=40),
    json_values.map(_json),
    envelopes.map(_json),
    st.integers(min_value=985, max_value=1_000).map(_deep),  # deep nesting, either side of Python's limit
    huge,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(elements, max_size=8), offline=st.lists(elements, max_size=8))
def test_fuzz_no_exception_escapes_and_nothing_is_lost(redis_parts, batch, offline):
    _, s, adapter, fetcher = redis_parts
    client = adapter.client
    queues = [s.queue_name(t) for t in TIERS]
    promoted = [q + ".promoted" for q in queues]
    client.delete(*queues, *promoted, s.dead_letter_queue, s.stats_key)
    # kombu's unacked hash is one per Redis db: other tests' killed workers may have left entries in it.
    unacked_before = client.hlen(fetcher.channel.unacked_key)
    fetcher._full_at = float("-inf")  # raw writes know no ready index: the worker's next full ask finds them
    if batch:
        client.lpush(queues[1], *batch)
    if offline:
        client.lpush(queues[2], *offline)
    pushed = len(batch) + len(offline)
    now = time.time()
    for when in (now, now + 10**7):  # once as is, once with everything due
        for tier in (B, O):
            adapter.promote_aged(s, tier, when)
        for q in queues:
            adapter.oldest_age(q, when)
    adapter.counters(s)
    drain_rate(client, s.stats_key, "batch")
    ran = 0
    for _ in range(4 * pushed + 4):  # the worker's own path: promoted lists first, tiers in order
        take = fetcher.take([R, B, O])
        if take.message is not None:
            msg = take.message
            assert headers_problem(msg.headers) is None
            enqueue_age(msg.headers, now)
            msg.ack()
            ran += 1
        elif not take.dead_lettered:
            assert take.empty == (R, B, O)
            break
    dead = client.llen(s.dead_letter_queue)
    assert ran + dead == pushed
    assert client.hlen(fetcher.channel.unacked_key) == unacked_before
    described = adapter.dead_list(s, limit=100)
    assert len(described) == dead and all(d["reason"] for d in described)
    moved, left, skipped = adapter.dead_requeue(s)
    assert moved + left == dead and skipped <= left
    assert sum(client.llen(k) for k in [*queues, *promoted]) == moved
