"""Redis's ready index (issue 37): a fetch asks only the lists that hold work, and never skips one that does.

Real Redis, the library's own publish paths (capped publish, sub-queues, bulk, kombu's restore) and fetch
script, publishers and fetchers running at once.
"""

from __future__ import annotations

import threading
import time

from celery_prio import settings_for
from celery_prio.brokers.redis.fetch import RedisFetchSource
from celery_prio.brokers.redis.ready import ReadyHeal
from celery_prio.brokers.redis.scripts import READY_LINGER
from celery_prio.policy.served import ServedQueues
from celery_prio.tiers import TIERS, Tier
from tests.test_untrusted import message


def adapter_client(env):
    """A Redis client on the app's broker db (the one its workers and publishers use)."""
    import redis

    return redis.Redis.from_url(env.app.conf.broker_url)


ORDER = [Tier.REALTIME, Tier.BATCH, Tier.OFFLINE]
TENANTS = ["acme", "globex", "initech"]


def _source(env, client_name: str):
    conn = env.app.connection_for_write()
    channel = conn.default_channel
    s = settings_for(env.app)
    subs = [s.subqueue_name(Tier.BATCH, t) for t in TENANTS]
    served = ServedQueues(s, [s.queue_name(t) for t in TIERS])
    served.set_discovered(subs)
    return conn, RedisFetchSource(env.app, channel, served, s, client_name)


def _index_misses(client, s, source) -> list[str]:
    """Lists with work that the index does not hold: must be none."""
    ready = {m.decode() for m in client.zrange(s.ready_key, 0, -1)}
    names = [k for n in source.served.all_names() for k in source.keys_for(n) if s.is_indexed(n)]
    return [k for k in names if client.llen(k) and k not in ready]


def _publish_and_take_one_tier_and_one_tenant_call(env, source) -> None:
    """A batch call to the tier list and one to tenant acme's sub-queue, both taken and acked by ``source``."""
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("tier", 0), tier="batch")
    sleep.apply_async(("tenant", 0), tier="batch", subqueue="acme")
    taken = []
    for _ in range(4):
        take = source.take(list(ORDER))
        if take.message is not None:
            taken.append(take.message.payload[0][0])
            take.message.ack()
        if len(taken) == 2:
            break
    assert sorted(taken) == ["tenant", "tier"]


def test_the_index_stays_exact_under_concurrent_publishers_and_fetchers(redis_env):
    env = redis_env
    env.configure(max_wait={"realtime": None})
    s = settings_for(env.app)
    sleep = env.app.tasks["t.sleep"]
    conn, source = _source(env, "fetcher-a")
    conn2, other = _source(env, "fetcher-b")
    source._full_at = other._full_at = float("inf")  # the index alone: a dropped entry would strand a message
    published, taken, stop = [], [], threading.Event()
    lock = threading.Lock()

    def publish(n: int, who: str) -> None:
        for i in range(n):
            tag = f"{who}{i}"
            tenant = TENANTS[i % len(TENANTS)] if i % 3 == 0 else None
            tier = ("batch", "offline", "realtime")[i % 3]
            sleep.apply_async((tag, 0), tier=tier, subqueue=tenant)
            with lock:
                published.append(tag)

    def fetch(src) -> None:
        while not stop.is_set():
            take = src.take(list(ORDER))
            if take.message is None:
                time.sleep(0.001)
                continue
            take.message.ack()
            with lock:
                taken.append(take.message.payload[0][0])

    publishers = [threading.Thread(target=publish, args=(150, w)) for w in ("p", "q")]
    fetchers = [threading.Thread(target=fetch, args=(src,)) for src in (source, other)]
    for t in publishers + fetchers:
        t.start()
    for t in publishers:
        t.join()
    deadline = time.monotonic() + 20
    while len(taken) < len(published) and time.monotonic() < deadline:
        assert not _index_misses(adapter_client(env), s, source)
        time.sleep(0.01)
    stop.set()
    for t in fetchers:
        t.join()
    conn.release()
    conn2.release()
    assert sorted(taken) == sorted(published)  # every one taken, once, without a full ask
    assert not _index_misses(adapter_client(env), s, source)


def test_a_restored_message_is_indexed_again(redis_env):
    env = redis_env
    s = settings_for(env.app)
    conn, source = _source(env, "fetcher-r")
    source._full_at = float("inf")
    env.app.tasks["t.sleep"].apply_async(("back", 0), tier="batch")
    take = source.take(list(ORDER))
    assert take.message.payload[0][0] == "back"
    assert source.take(list(ORDER)).message is None  # found empty: out of the index
    assert s.queue_name(Tier.BATCH) not in {m.decode() for m in adapter_client(env).zrange(s.ready_key, 0, -1)}
    source.channel.qos.restore_by_tag(take.message.delivery_tag, client=source.channel.client)  # kombu's restore
    again = source.take(list(ORDER))
    assert again.message is not None and again.message.payload[0][0] == "back"
    again.message.ack()
    conn.release()


def test_a_writer_that_does_not_know_the_index_is_seen_by_a_full_ask_and_the_housekeepers_round(redis_env):
    """A full ask (once a second at most, when the index found nothing) sees a raw push into a tier list; the
    housekeeper's round sees one into any list of the fleet."""
    env = redis_env
    s = settings_for(env.app)
    conn, source = _source(env, "fetcher-f")
    queue = s.queue_name(Tier.OFFLINE)
    adapter_client(env).lpush(queue, message(task_id="raw1"))  # a plain LPUSH: no index entry
    source._full_at = float("inf")
    assert source.take(list(ORDER)).message is None  # the index alone does not see it
    source._full_at = float("-inf")  # the once-a-second full ask does, and mends the index
    adapter_client(env).lpush(queue, message(task_id="raw2"))
    take = source.take(list(ORDER))
    assert take.message is not None and take.message.headers["id"] == "raw1"
    take.message.ack()
    assert queue in {m.decode() for m in adapter_client(env).zrange(s.ready_key, 0, -1)}
    # The housekeeper's round puts a missing list back without any fetch.
    adapter_client(env).zrem(s.ready_key, queue)
    heal = ReadyHeal(s)
    assert heal.run(source.channel) == 1 and heal.run(source.channel) == 0
    assert queue in {m.decode() for m in adapter_client(env).zrange(s.ready_key, 0, -1)}
    # A full ask looks at the lists a writer that does not know the index pushes to (tier lists, lanes: one
    # EXISTS each, no pop of an empty one); a sub-queue's list is celery-prio's own, left to the round.
    client, acme = adapter_client(env), s.subqueue_name(Tier.BATCH, "acme")
    take = source.take(list(ORDER))
    take.message.ack()  # raw2
    client.sadd(s.subqueue_registry, acme)  # a tenant publishers registered
    client.lpush(acme, message(task_id="raw-sub"))  # not indexed
    source._full_at = float("-inf")
    assert source.take(list(ORDER)).message is None  # a full ask costs the same whatever the tenants served
    assert queue not in {m.decode() for m in client.zrange(s.ready_key, 0, -1)}  # the emptied tier list left
    assert heal.run(source.channel) == 1  # the round finds the sub-queue's list ...
    take = source.take(list(ORDER))
    assert take.message is not None and take.message.headers["id"] == "raw-sub"  # ... and the next fetch takes it
    take.message.ack()
    conn.release()


def test_a_tier_list_joining_keeps_copies_current_and_a_sub_queue_list_joining_moves_them(redis_env):
    """Work landing in an emptied tier list must not make every worker read the index again (each worker passes
    the tier lists and lanes whatever its copy holds); a sub-queue's list joining must move the version, by
    every path that can push into one (the publish script, kombu's restore), or a worker whose copy predates it
    would pass it over for good. A sub-queue's list found empty lingers in the index for ``READY_LINGER`` (work
    coming back meanwhile moves nothing and starts the linger again at the next empty look), then leaves it."""
    env = redis_env
    s = settings_for(env.app)
    client, version = adapter_client(env), lambda: client.get(s.ready_key + ".version")
    conn, source = _source(env, "fetcher-v")
    source._full_at = float("inf")
    sleep = env.app.tasks["t.sleep"]
    assert source.take(list(ORDER)).message is None  # the copy is read
    before = version()
    for i in range(3):
        sleep.apply_async((f"b{i}", 0), tier="batch")
        take = source.take(list(ORDER))
        assert take.message.payload[0][0] == f"b{i}"
        take.message.ack()
        assert source.take(list(ORDER)).message is None  # found empty: out of the index, joins again next time
        assert s.queue_name(Tier.BATCH) not in {m.decode() for m in client.zrange(s.ready_key, 0, -1)}
    assert version() == before
    sleep.apply_async(("sub", 0), tier="batch", subqueue="acme")
    assert version() != before
    take = source.take(list(ORDER))
    if take.message is None:  # the tenant is new to the registry too: the reply shows it, asked again
        take = source.take(list(ORDER))
    assert take.message.payload[0][0] == "sub"
    members = lambda: {m.decode() for m in client.zrange(s.ready_key, 0, -1)}  # noqa: E731
    acme = s.subqueue_name(Tier.BATCH, "acme")
    assert source.take(list(ORDER)).message is None  # found empty: the sub-queue's list lingers in the index
    assert acme in members()
    before = version()
    sleep.apply_async(("sub2", 0), tier="batch", subqueue="acme")  # work again while it lingers: no move
    assert version() == before
    second = source.take(list(ORDER))
    assert second.message.payload[0][0] == "sub2"
    second.message.ack()
    assert source.take(list(ORDER)).message is None  # found empty again: its linger starts again
    assert acme in members() and client.zscore(s.ready_key, acme) > 0
    time.sleep(READY_LINGER + 0.2)
    assert source.take(list(ORDER)).message is None  # passed over past its linger: out of the index
    assert acme not in members()
    conn2, other = _source(env, "fetcher-w")  # a second worker, its copy read now (without the list)
    other._full_at = float("inf")
    assert other.take(list(ORDER)).message is None
    before = version()
    source.channel.qos.restore_by_tag(take.message.delivery_tag, client=source.channel.client)  # kombu's restore
    assert version() != before
    again = other.take(list(ORDER))
    assert again.message is not None and again.message.payload[0][0] == "sub"
    again.message.ack()
    conn.release()
    conn2.release()


def test_the_housekeepers_round_takes_out_lists_no_fetch_will_find_empty(redis_env):
    """A list emptied by a take stays indexed until a fetch asks it again, and a busy fetch stops at its first hit:
    an idle tenant ordered after a busy list would stay in the index for good (a key and a member test in every
    fetch). The housekeeper's round takes it out: a tier list at once, a sub-queue's after its linger."""
    env = redis_env
    s = settings_for(env.app)
    client = adapter_client(env)
    members = lambda: {m.decode() for m in client.zrange(s.ready_key, 0, -1)}  # noqa: E731
    conn, source = _source(env, "fetcher-h")
    source._full_at = float("inf")
    _publish_and_take_one_tier_and_one_tenant_call(env, source)
    tier_list, acme = s.queue_name(Tier.BATCH), s.subqueue_name(Tier.BATCH, "acme")
    # As a take that emptied them leaves them (whichever the fetches above happened to ask again):
    client.zadd(s.ready_key, {tier_list: 0, acme: 0})
    heal = ReadyHeal(s)
    assert heal.run(source.channel) == 0
    assert tier_list not in members() and acme in members()  # the tier list at once; the tenant lingers
    env.app.tasks["t.sleep"].apply_async(("again", 0), tier="batch", subqueue="acme")  # work while it lingers: it stays
    time.sleep(READY_LINGER + 0.2)
    heal.run(source.channel)
    assert acme in members()
    take = source.take(list(ORDER))
    assert take.message.payload[0][0] == "again"
    take.message.ack()
    heal.run(source.channel)  # empty again: its linger starts again from now ...
    assert acme in members()
    time.sleep(READY_LINGER + 0.2)
    heal.run(source.channel)  # ... and is over a linger later
    assert acme not in members()
    conn.release()


def test_a_lingering_list_costs_a_fetch_nothing_and_a_raw_push_to_it_is_found_by_the_round(redis_env):
    """A sub-queue's list found empty lingers in the index with the time it was found empty as its score; a
    fetch passes it over without a look (under a realtime trickle each worker's fetch looked at it and read its
    linger: two commands a task). A celery-prio push sets its score back to 0, so it is asked again at once; a
    writer that does not know the index is seen at the housekeeper's next round, as for a list not indexed."""
    env = redis_env
    s = settings_for(env.app)
    client = adapter_client(env)
    conn, source = _source(env, "fetcher-l")
    source._full_at = float("inf")  # the index alone
    sleep = env.app.tasks["t.sleep"]
    acme = s.subqueue_name(Tier.BATCH, "acme")
    sleep.apply_async(("first", 0), tier="batch", subqueue="acme")
    take = source.take(list(ORDER))
    take = take if take.message is not None else source.take(list(ORDER))  # the tenant is new: copy read again
    take.message.ack()
    assert source.take(list(ORDER)).message is None  # found empty: it lingers
    since = client.zscore(s.ready_key, acme)
    assert since > 0
    client.lpush(acme, message(task_id="raw"))  # a writer that does not know the index
    assert source.take(list(ORDER)).message is None  # passed over: its score says empty, nothing looked at it
    assert client.zscore(s.ready_key, acme) == since and client.llen(acme) == 1
    ReadyHeal(s).run(source.channel)  # the round sees work in a lingering list: asked again
    assert client.zscore(s.ready_key, acme) == 0
    take = source.take(list(ORDER))
    assert take.message is not None and take.message.headers["id"] == "raw"
    take.message.ack()
    assert source.take(list(ORDER)).message is None  # lingers again
    sleep.apply_async(("pushed", 0), tier="batch", subqueue="acme")  # a celery-prio push: asked at once
    assert client.zscore(s.ready_key, acme) == 0
    take = source.take(list(ORDER))
    assert take.message is not None and take.message.payload[0][0] == "pushed"
    take.message.ack()
    conn.release()


def test_a_fetch_orders_and_asks_only_queues_with_work_and_reports_the_others_now_and_then(redis_env):
    """500 tenants served, one with work: the fetch passes the script that tenant's lists and the tier lists,
    not 2,000 keys, and the idle tenants are reported empty at most every ``UNASKED_REPORT_INTERVAL``-ish
    (their share lifted when they come back), not on every fetch."""
    from celery_prio.brokers.redis import asking

    env = redis_env
    s = settings_for(env.app)
    conn, source = _source(env, "fetcher-o")
    source.served.set_known([s.subqueue_name(Tier.BATCH, f"t{i}") for i in range(500)])  # not from the registry
    source._full_at = float("inf")
    sleep = env.app.tasks["t.sleep"]
    assert source.take(list(ORDER)).message is None  # the copy is read
    for i in range(3):
        sleep.apply_async((f"w{i}", 0), tier="batch", subqueue="t7")
    take = source.take(list(ORDER))
    if take.message is None:  # the tenant joined the index since the copy: asked again at once
        take = source.take(list(ORDER))
    assert take.message.payload[0][0] == "w0"
    take.message.ack()
    asked = {c.name for _, c in source.plan.lists(list(ORDER))}
    assert s.subqueue_name(Tier.BATCH, "t7") in asked and len(asked) <= 10, sorted(asked)
    # The idle tenants were reported with the first fetch after the copy; not with the next ones.
    second = source.take(list(ORDER))
    assert second.message.payload[0][0] == "w1" and len(second.empty_queues) < 10
    second.message.ack()
    source.plan._unasked_reported.clear()  # as if the report were due
    third = source.take(list(ORDER))
    assert third.message.payload[0][0] == "w2" and len(third.empty_queues) >= 499
    third.message.ack()
    assert asking.UNASKED_REPORTS_PER_S * 2 >= 500  # 500 idle tenants: reported every 2 s at most
    conn.release()


def test_the_doorbells_net_sees_lists_with_work_by_the_index_and_uncovered_lists_by_exists(redis_env):
    """At each doorbell timeout an idle worker asks whether any list it serves holds work, in one round trip:
    the index for the lists it covers (a raw push the housekeeper's round has put back), EXISTS for the rest."""
    env = redis_env
    s = settings_for(env.app)
    client = adapter_client(env)
    conn, source = _source(env, "fetcher-d")
    acme = s.subqueue_name(Tier.BATCH, "acme")
    waiting = lambda: source.plan.anything_waiting(source.channel.client, list(ORDER))  # noqa: E731
    env.app.tasks["t.sleep"].apply_async(("x", 0), tier="batch", subqueue="acme")  # the tenant is registered
    assert waiting()
    source._full_at = float("inf")
    take = source.take(list(ORDER))
    take = take if take.message is not None else source.take(list(ORDER))
    take.message.ack()
    client.zrem(s.ready_key, acme)  # as after its linger
    assert not waiting()
    client.lpush(acme, message(task_id="raw-sub"))  # a writer that does not know the index
    assert not waiting()  # not indexed yet: the housekeeper's round puts it there ...
    ReadyHeal(s).run(source.channel)
    assert waiting()  # ... and the next timeout sees it
    client.delete(acme)
    client.zrem(s.ready_key, acme)
    assert not waiting()
    client.lpush(s.queue_name(Tier.OFFLINE), message(task_id="raw-tier"))  # a tier list: always asked by EXISTS
    assert waiting()
    client.delete(s.queue_name(Tier.OFFLINE))
    conn.release()


def test_a_batch_fetch_leaves_what_it_does_not_take_where_it_was(redis_env):
    """The fetch script pops before it looks (one command a task, not a look and a pop): a batch that stops at
    another task's call, or at a malformed element after the calls it took, pushes that element back to the
    same end. Nothing is lost and the list's order is what it was; the malformed one goes aside at the next
    fetch, alone."""
    from tests.test_untrusted import ids_in

    env = redis_env
    s = settings_for(env.app)
    client = adapter_client(env)
    conn, source = _source(env, "fetcher-e")
    queue = s.queue_name(Tier.BATCH)
    for task_id, task in (("a1", "t.noop"), ("a2", "t.noop"), ("b1", "t.other"), ("a3", "t.noop")):
        client.lpush(queue, message(task_id=task_id, task=task))
    client.zadd(s.ready_key, {queue: 0})
    taken = source.take_more(queue, Tier.BATCH, 10, "t.noop")
    assert [m.headers["id"] for m in taken] == ["a1", "a2"]  # stopped at another task's call
    assert ids_in(client, queue) == ["b1", "a3"]  # b1 back where it was, still the oldest
    client.delete(queue)
    client.lpush(queue, message(task_id="a4"))
    client.lpush(queue, b"not json")
    client.lpush(queue, message(task_id="a5"))
    taken += source.take_more(queue, Tier.BATCH, 10, "t.noop")
    assert [m.headers["id"] for m in taken[2:]] == ["a4"]  # the batch so far goes first
    assert client.llen(queue) == 2 and client.lindex(queue, -1) == b"not json"
    assert client.llen(s.dead_letter_queue) == 0
    taken += source.take_more(queue, Tier.BATCH, 10, "t.noop")  # moves the malformed element aside, then a5
    assert [m.headers["id"] for m in taken[3:]] == ["a5"] and client.llen(queue) == 0
    assert client.llen(s.dead_letter_queue) == 1
    for m in taken:
        m.ack()
    conn.release()


def test_an_index_left_as_a_plain_set_by_an_earlier_build_breaks_no_publish_or_fetch(redis_env):
    """Builds before the index's scores kept it as a plain set at ``<prefix>.ready``; a sorted-set command on
    that key fails with WRONGTYPE. A Redis that such a fleet used still holds the set, and each publish and
    fetch must work beside it: the index lives under another name, and the old set is never touched."""
    env = redis_env
    s = settings_for(env.app)
    client = adapter_client(env)
    old = f"{s.queue_prefix}.ready"
    assert s.ready_key != old
    client.sadd(old, s.queue_name(Tier.BATCH))
    conn, source = _source(env, "fetcher-old-set")
    _publish_and_take_one_tier_and_one_tenant_call(env, source)
    assert client.type(old) == b"set" and client.type(s.ready_key) in (b"zset", b"none")
    client.delete(old)
    conn.release()
