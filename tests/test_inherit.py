"""Priority inheritance at publish time (issue 14, first part): canvases and children, real workers."""

from __future__ import annotations

import pytest
from celery import chain, chord

from celery_prio.producer.inherit import lift
from celery_prio.settings import load_settings
from celery_prio.tiers import Tier


def queues(env) -> dict[str, str]:
    """tag -> the queue (tier queue or sub-queue) each ``t.where`` ran from."""
    out = {}
    for x in env.log():
        if x["kind"] == "where":
            tag, _, queue = x["tag"].partition(":")
            out[tag] = queue
    return out


def tier_of(env, queue: str) -> str:
    return load_settings(env.app.conf).tier_for_queue(queue).label


def test_pure_lift_of_nested_canvases(redis_env):
    app = redis_env.app
    settings = load_settings(app.conf)
    where, add = app.tasks["t.where"], app.tasks["t.add"]
    inner = chord([where.s(tag="h").set(tier="offline")], where.s(tag="b"))  # body: default tier (batch)
    canvas = chain(where.s(tag="a").set(tier="offline"), inner, add.s(1))  # ends in realtime
    assert lift(settings, canvas, None) is Tier.REALTIME
    assert canvas.tasks[0].options["tier"] == "realtime"


def test_chain_steps_before_a_realtime_step_run_at_realtime(env):
    env.start_worker(concurrency=2)
    where, add = env.app.tasks["t.where"], env.app.tasks["t.add"]
    result = chain(where.si(tag="a").set(tier="offline"), where.si(tag="b"), add.si(1, 2)).apply_async()
    assert result.get(timeout=30) == 3
    ran = queues(env)
    assert tier_of(env, ran["a"]) == "realtime" and tier_of(env, ran["b"]) == "realtime", ran


def test_chord_header_runs_at_its_body_tier_and_explicit_higher_tiers_stay(env):
    env.start_worker(concurrency=2)
    where, add = env.app.tasks["t.where"], env.app.tasks["t.add"]
    header = [where.si(tag="h1").set(tier="offline"), where.si(tag="h2").set(tier="realtime"), where.si(tag="h3")]
    body = where.si(tag="body").set(tier="batch")
    assert chord(header)(body).get(timeout=30) == "body"
    ran = queues(env)
    assert [tier_of(env, ran[t]) for t in ("h1", "h2", "h3", "body")] == ["batch", "realtime", "batch", "batch"]
    # A chord inside a chain that ends in realtime: the whole chord runs at realtime.
    result = chain(chord([where.si(tag="c1").set(tier="offline")], where.si(tag="c2")), add.si(2, 2)).apply_async()
    assert result.get(timeout=30) == 4
    ran = queues(env)
    assert tier_of(env, ran["c1"]) == "realtime" and tier_of(env, ran["c2"]) == "realtime", ran


@pytest.mark.parametrize("inherit", [True, False])
def test_children_of_a_running_task_default_to_its_tier(redis_env, inherit):
    env = redis_env
    env.configure(inherit=inherit)
    env.start_worker(concurrency=2)
    where = env.app.tasks["t.where"]
    where.apply_async(kwargs={"tag": "parent", "spawn": True}, tier="offline")
    env.wait_for(lambda: "parent-child" in queues(env), what="the child to run")
    ran = queues(env)
    assert tier_of(env, ran["parent"]) == "offline"
    assert tier_of(env, ran["parent-child"]) == ("offline" if inherit else "batch")


def test_a_chord_header_generator_is_unrolled_as_celery_publishes_it_and_each_member_is_lifted(redis_env):
    """Celery publishes a generator header incrementally (celery #3021): inheritance must not unroll it
    first. The generator looks, as it yields each member, at how many members are already on the broker:
    the same as with inheritance off (Celery's own order), and members are lifted as they are taken."""
    env = redis_env
    batch, offline = env.queue(Tier.BATCH), env.queue(Tier.OFFLINE)

    def publish(tag: str) -> tuple[list[int], object]:
        where = env.app.tasks["t.where"]
        seen = []

        def header():
            for i in range(4):
                seen.append(env.adapter.depth(batch) + env.adapter.depth(offline))
                yield where.si(tag=f"{tag}{i}").set(tier="offline")  # lifted to the body's tier as it is taken

        return seen, chord(header(), where.s(tag=f"{tag}-body").set(tier="batch")).apply_async()

    env.configure(inherit=False)
    plain, _ = publish("p")
    env.adapter.delete_queues([batch, offline])
    env.configure(inherit=True)
    seen, result = publish("g")
    assert seen == plain and seen[-1] >= 1, (seen, plain)  # incremental, as Celery does it
    assert env.adapter.depth(batch) == 4 and env.adapter.depth(offline) == 0  # every member lifted to batch
    env.start_worker(concurrency=2)
    assert result.get(timeout=30) == "g-body"
    ran = queues(env)
    assert [tier_of(env, ran[f"g{i}"]) for i in range(4)] == ["batch"] * 4
