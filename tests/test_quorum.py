"""RabbitMQ quorum queues (issue 16): ``prio_queue_type = "quorum"`` on a real three-node cluster
started once for this module, with the leader of the tier queues stopped in the middle of a mixed load."""

from __future__ import annotations

import os
import threading
import time

import pytest

import celery_prio
from celery_prio.brokers import adapter_for
from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS, Tier
from tests.conftest import PrioEnv
from tests.rabbit_cluster import RabbitCluster, ctl

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE
#: Tests on the cluster: a broker of their own, and the last one starts workers.
CLUSTER = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    try:
        cluster = RabbitCluster()
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc} (CI=true: the cluster tests must run)", pytrace=False)
        pytest.skip(str(exc))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def runs(env: PrioEnv, tag: str) -> int:
    return sum(1 for x in env.log() if x["kind"] == "start" and x["tag"] == tag)


def queue_types(cluster: RabbitCluster, prefix: str) -> dict[str, str]:
    node = next(n for n in cluster.nodes if n.name in cluster.running())
    out = ctl(node, "list_queues", "-q", "--no-table-headers", "name", "type")
    return {
        name: kind
        for name, kind in (line.split() for line in out.splitlines() if line.strip())
        if name.startswith(prefix)
    }


def cluster_env(cluster: RabbitCluster, tmp_path, **settings) -> PrioEnv:
    env = PrioEnv("amqp", tmp_path, broker=cluster.urls)
    env.configure(queue_type="quorum", management_url=cluster.management_url, **settings)
    return env


def fill(env: PrioEnv, tier: Tier, n: int, tag: str) -> int:
    """Publish ``n`` tasks one by one; how many the tier refused."""
    refused = 0
    for i in range(n):
        try:
            env.app.tasks["t.sleep"].apply_async((f"{tag}{i}", 0.0), tier=tier.label)
        except celery_prio.QueueFull:
            refused += 1
    return refused


@CLUSTER
def test_quorum_queues_keep_caps_aging_and_dead_letters(cluster, tmp_path):
    env = cluster_env(cluster, tmp_path, max_length={"batch": 40, "offline": 5}, aging={"offline": 1})
    try:
        settings = load_settings(env.app.conf)
        assert fill(env, B, 50, "c") == 10 and env.depth(B) == 40  # exactly the cap, one publish at a time
        fill(env, O, 8, "o")  # drop_oldest: the 3 oldest go to the dead letters
        assert env.depth(O) == 5
        assert sorted(e["reason"] for e in env.adapter.dead_list(settings)) == ["drop_oldest"] * 3
        with pytest.raises(celery_prio.BulkQueueFull) as full:
            celery_prio.bulk(env.app.tasks["t.sleep"], [("x", 0.0)] * 5, tier="batch")
        assert full.value.accepted == [] and env.depth(B) == 40

        types = queue_types(cluster, env.prefix)
        expected = [env.queue(t) for t in TIERS] + [f"{env.queue(t)}.promoted" for t in (R, B)] + [f"{env.prefix}.dead"]
        assert {types.get(name) for name in expected} == {"quorum"}, types

        # A worker without the offline tier: the offline tasks age (TTL, dead-lettered) into batch and run.
        env.start_worker(concurrency=4, queues=[env.queue(R), env.queue(B)])
        env.wait_for(lambda: all(runs(env, f"c{i}") for i in range(40)), timeout=60, what="the capped tasks")
        env.wait_for(lambda: all(runs(env, f"o{i}") for i in range(3, 8)), timeout=60, what="aged offline tasks")
        assert queue_types(cluster, env.prefix).get(f"{env.prefix}.fleet") == "quorum"
        env.workers[0].kill()

        # bulk into an empty capped quorum queue: cut at the cap, not overshot by the chunk in flight.
        with pytest.raises(celery_prio.BulkQueueFull) as full:
            celery_prio.bulk(env.app.tasks["t.sleep"], ((f"k{i}", 0.0) for i in range(60)), tier="batch", chunk=25)
        assert len(full.value.accepted) == 40 and env.depth(B) == 40
    finally:
        env.close()


@CLUSTER
def test_racing_publishers_overshoot_a_quorum_cap_by_at_most_one_each(cluster, tmp_path):
    """RabbitMQ checks a quorum queue's cap after the fact: concurrent publishers can each land one over it."""
    env = cluster_env(cluster, tmp_path, max_length={"batch": 100})
    try:
        results: list[int] = []
        threads = [threading.Thread(target=lambda n=n: results.append(fill(env, B, 40, f"r{n}-"))) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        depth = env.depth(B)
        print(f"\nquorum cap 100, 8 racing publishers: depth {depth}, refused {sum(results)} of 320")
        assert 320 - sum(results) == depth and 100 <= depth <= 100 + 8 - 1
    finally:
        env.close()


@CLUSTER
def test_losing_the_leader_mid_load_loses_no_accepted_task(cluster, tmp_path):
    env = cluster_env(cluster, tmp_path, max_length={"realtime": 50})
    leader = None
    try:
        env.app.tasks["t.sleep"].apply_async(("warm", 0.0), tier="batch")  # declares the queues
        leader = cluster.leader(env.queue(R))
        others = [n for n in cluster.nodes if n is not leader]
        # Each worker starts on a different node; the publisher on the leader itself (the worst case).
        for first in (leader, others[0]):
            order = [first, *[n for n in cluster.nodes if n is not first]]
            env.start_worker(concurrency=4, env_extra={"PRIO_TEST_BROKER": ";".join(n.url for n in order)})
        env.wait_for(lambda: runs(env, "warm") == 1, timeout=30, what="the first task")

        publisher_url = ";".join(n.url for n in [leader, *others])
        publisher = PrioEnv("amqp", tmp_path, broker=publisher_url)
        publisher.prefix = env.prefix
        publisher.configure(queue_type="quorum", management_url=cluster.management_url, max_length={"realtime": 50})
        sleep = publisher.app.tasks["t.sleep"]
        accepted, failures, took = [], [], []

        def publish() -> None:
            for i in range(400):
                started = time.monotonic()
                try:
                    sleep.apply_async((f"f{i}", 0.01), tier=("realtime", "batch", "offline")[i % 3])
                    accepted.append(f"f{i}")
                except Exception as exc:  # what a caller sees while the leader moves
                    failures.append((time.monotonic(), type(exc).__name__, str(exc)[:120]))
                took.append(time.monotonic() - started)
                time.sleep(0.01)

        thread = threading.Thread(target=publish)
        thread.start()
        time.sleep(1.5)
        stopped_at = time.monotonic()
        cluster.stop_node(leader)
        stop_took = time.monotonic() - stopped_at
        thread.join(180)
        env.adapter.close()
        env.adapter = adapter_for(env.app)  # its connection may have been to the stopped node
        env.wait_for(lambda: all(runs(env, tag) for tag in accepted), timeout=120, what="every accepted task to run")
        new_leader = cluster.leader(env.queue(R))
        duplicates = sum(runs(env, tag) > 1 for tag in accepted)
        window = failures[-1][0] - failures[0][0] if failures else 0.0
        print(
            f"\nquorum leader {leader.name} stopped ({stop_took:.1f} s), new leader {new_leader.name}: "
            f"{len(accepted)} of 400 accepted, {len(failures)} failed in {window:.2f} s "
            f"{sorted({f[1] for f in failures})}, duplicates {duplicates}; slowest publish {max(took):.2f} s"
        )
        assert new_leader is not leader
        assert len(accepted) >= 350, failures

        # The cap still holds on the new leader: workers gone, 60 publishes into a cap of 50.
        for worker in env.workers:
            worker.kill()
        assert fill(publisher, R, 60, "cap") == 10 and env.depth(R) == 50
        publisher.adapter.close()
    finally:
        if leader is not None and leader.name not in cluster.running():
            cluster.start_node(leader)
        env.close()


def test_quorum_arguments_map_caps_aging_and_dead_lettering():
    """Pure: what each queue is declared with (classic unchanged; quorum as the docstring explains)."""
    from celery_prio.brokers.amqp.topology import queue_arguments

    caps = {"max_length": {"realtime": 10, "batch": 100, "offline": 1000}, "aging": {"batch": 60, "offline": 60}}
    classic = load_settings({}, {"queue_prefix": "q", **caps})
    quorum = load_settings({}, {"queue_prefix": "q", "queue_type": "quorum", **caps})
    assert queue_arguments(classic, R) == {"x-max-length": 10, "x-overflow": "reject-publish"}
    assert queue_arguments(quorum, R) == {
        "x-queue-type": "quorum",
        "x-max-length": 9,  # RabbitMQ's quorum queues hold one over their limit
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": "q.realtime.dlx",
        "x-dead-letter-strategy": "at-least-once",
    }
    assert queue_arguments(quorum, B)["x-dead-letter-strategy"] == "at-least-once"
    offline = queue_arguments(quorum, O)  # drop_oldest: RabbitMQ dead-letters at most once there
    assert offline["x-overflow"] == "drop-head" and offline["x-max-length"] == 1000
    assert offline["x-dead-letter-strategy"] == "at-most-once" and offline["x-message-ttl"] == 60_000
    uncapped = load_settings({}, {"queue_type": "quorum", "max_length": {"realtime": None}})
    assert queue_arguments(uncapped, R)["x-overflow"] == "reject-publish"  # what at-least-once needs
    assert load_settings({"task_default_queue_type": "quorum"}).queue_type == "quorum"  # Celery's own setting
    assert load_settings({}).queue_type == "classic"
    with pytest.raises(celery_prio.ConfigError, match=r"prio_queue_type must be one of \('classic', 'quorum'\)"):
        load_settings({}, {"queue_type": "stream"})
    with pytest.raises(celery_prio.ConfigError, match="task_default_queue_type must be one of"):
        load_settings({"task_default_queue_type": "mirrored"})
