"""The consumer with real workers on real Redis and RabbitMQ (both, each test)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from celery import chord

from celery_prio.tiers import Tier
from celery_prio.worker.control import collect_prio_stats

pytestmark = [pytest.mark.broker, pytest.mark.slow]

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def tasks(env):
    return env.app.tasks


def starts(env, prefix=""):
    return [e for e in env.log() if e["kind"] == "start" and e["tag"].startswith(prefix)]


def running(env, prefix=""):
    log = env.log()
    ended = {e["tag"] for e in log if e["kind"] == "end"}
    return sum(1 for e in log if e["kind"] == "start" and e["tag"].startswith(prefix) and e["tag"] not in ended)


def slot_time_shares(env, first_starts: int) -> dict[str, float]:
    """Share of busy time per tier letter (R/B/O) over the window of the first N task starts."""
    log = env.log()
    ends = {e["tag"]: e["t"] for e in log if e["kind"] == "end"}
    window = [e for e in log if e["kind"] == "start"][:first_starts]
    t1 = window[-1]["t"]
    busy = Counter()
    for e in window:
        busy[e["tag"][0]] += max(0.0, min(ends.get(e["tag"], t1), t1) - e["t"])
    return {k: v / sum(busy.values()) for k, v in busy.items()}


def backlog(env, n_rt=300, n_batch=60, n_off=30, off_seconds=0.2):
    t = tasks(env)
    for i in range(n_rt):
        t["t.sleep"].apply_async((f"R{i}", 0.02), tier="realtime")
    for i in range(n_batch):
        t["t.sleep"].apply_async((f"B{i}", 0.1), tier="batch")
    for i in range(n_off):
        t["t.sleep"].apply_async((f"O{i}", off_seconds), tier="offline")


def test_backlogged_tiers_share_slot_time_by_weight(env):
    env.configure(min_share=0)  # the floor is tested on its own below
    backlog(env)  # every tier has work from the first fetch on
    env.start_worker(concurrency=4)
    env.wait_for(lambda: len(starts(env)) >= 160, timeout=60, what="160 task starts")
    shares = slot_time_shares(env, 140)  # while all three tiers are still backlogged
    assert shares["R"] == pytest.approx(8 / 11, abs=0.12), shares
    assert shares["B"] == pytest.approx(2 / 11, abs=0.08), shares
    assert shares["O"] == pytest.approx(1 / 11, abs=0.08), shares


def test_offline_floor_holds_while_realtime_could_fill_the_worker(env):
    # By weight (100:1:1) offline would get ~2 % of slot time; the floor
    # (prio_min_share=10) lifts it to 10 %.
    env.configure(weights={"realtime": 100, "batch": 1, "offline": 1}, min_share=10)
    backlog(env, n_rt=600, n_batch=0, n_off=60)
    env.start_worker(concurrency=4)
    env.wait_for(lambda: len(starts(env)) >= 330, timeout=60, what="330 task starts")
    shares = slot_time_shares(env, 300)
    assert 0.06 <= shares["O"] <= 0.2, shares


def test_realtime_starts_promptly_while_long_offline_tasks_fill_the_worker(env):
    t = tasks(env)
    env.start_worker(concurrency=4)
    for i in range(8):
        t["t.slow_late"].delay(f"long{i}", 4.0)
    # The first offline task runs alone until its length is known, then
    # three run side by side: the 4th slot is held for realtime.
    env.wait_for(lambda: running(env, "long") >= 3, timeout=20, what="3 long offline tasks running")
    time.sleep(0.3)
    assert running(env, "long") == 3
    sent = time.time()
    t["t.rt_sleep"].delay("rt", 0.05)
    env.wait_for(lambda: starts(env, "rt"), timeout=10, what="the realtime task to start")
    waited = starts(env, "rt")[0]["t"] - sent
    assert waited < 1.0, f"realtime waited {waited:.2f} s behind 4 s offline tasks"


def test_eta_retry_and_chord_across_tiers(env):
    t = tasks(env)
    env.start_worker(concurrency=2)
    sent = time.time()
    eta = t["t.sleep"].apply_async(("eta", 0.0), countdown=1.5, tier="offline")
    flaky = t["t.flaky"].delay("f")
    result = chord([t["t.add"].s(i, i) for i in range(5)])(t["t.tsum"].s())
    assert result.get(timeout=20) == 20
    assert flaky.get(timeout=20) == "f"
    assert eta.get(timeout=20) == "eta"
    assert starts(env, "eta")[0]["t"] - sent >= 1.4
    tries = [e["kind"] for e in env.log() if e["tag"] == "f"]
    assert tries == ["try0", "try1"]


def test_sigkill_mid_task_with_acks_late_loses_nothing(env):
    env.configure(visibility_timeout=2, redeliver_after={"offline": 2})  # Redis: the dead owner's are returned
    t = tasks(env)
    worker = env.start_worker(concurrency=2)
    for i in range(6):
        t["t.slow_late"].delay(f"k{i}", 1.5)
    env.wait_for(lambda: len(starts(env, "k")) >= 2, what="two tasks running")
    worker.kill()  # SIGKILL, worker and children, mid-task
    killed_mid_task = {e["tag"] for e in starts(env)} - {e["tag"] for e in env.log() if e["kind"] == "end"}
    assert killed_mid_task
    env.start_worker(concurrency=2)
    done = lambda: {e["tag"] for e in env.log() if e["kind"] == "end"}  # noqa: E731
    env.wait_for(lambda: done() == {f"k{i}" for i in range(6)}, timeout=60, what="all 6 tasks to finish")


def test_warm_shutdown_finishes_running_tasks_and_leaves_the_rest_queued(env):
    t = tasks(env)
    worker = env.start_worker(concurrency=2)
    for i in range(6):
        t["t.slow_late"].delay(f"w{i}", 1.0)
    env.wait_for(lambda: len(starts(env, "w")) >= 2, what="two tasks running")
    assert worker.stop() == 0
    log = env.log()
    started = {e["tag"] for e in log if e["kind"] == "start"}
    ended = {e["tag"] for e in log if e["kind"] == "end"}
    assert started == ended  # every started task finished
    env.wait_for(lambda: env.depth(O) == 6 - len(ended), what="unstarted tasks back in the queue")


def test_worker_with_q_serves_only_its_tier_and_queues_can_be_added(env):
    t = tasks(env)
    env.start_worker(concurrency=2, queues=[env.queue(R)])
    t["t.sleep"].apply_async(("batch-1", 0.0), tier="batch")
    assert t["t.rt_sleep"].delay("rt-1", 0.0).get(timeout=10) == "rt-1"
    time.sleep(0.5)
    assert env.depth(B) == 1
    active = env.app.control.inspect(timeout=2).active_queues()
    # The tier queue, then the sub-queues served beside it (listed so Flower shows their depths): the one its
    # realtime calls waited in (on RabbitMQ also those its workers declared up front), all in realtime.
    listed = [q["name"] for q in next(iter(active.values()))]
    assert listed[0] == env.queue(R) and f"{env.queue(R)}.sjf-t-rt_sleep" in listed
    assert all(name.startswith(env.queue(R) + ".") for name in listed[1:]), listed
    env.app.control.add_consumer(env.queue(B), reply=True, timeout=2)
    env.wait_for(lambda: starts(env, "batch-1"), what="the batch task after add_consumer")
    env.app.control.cancel_consumer(env.queue(B), reply=True, timeout=2)
    t["t.sleep"].apply_async(("batch-2", 0.0), tier="batch")
    time.sleep(0.5)
    assert env.depth(B) == 1


def test_inspect_stats_show_per_tier_dispatch_counts(env):
    t = tasks(env)
    env.start_worker(concurrency=2)
    tiers = ["realtime", "p0", "batch", 1, "offline"]
    results = [t["t.sleep"].apply_async((f"s{i}", 0.0), tier=tier) for i, tier in enumerate(tiers)]
    [r.get(timeout=10) for r in results]
    from celery_prio.worker.control import collect_prio_stats

    (report,) = collect_prio_stats(env.app, timeout=2, limit=1).values()
    prio = report["tiers"]
    assert (prio["realtime"]["dispatched"], prio["batch"]["dispatched"], prio["offline"]["dispatched"]) == (2, 2, 1)
    assert prio["realtime"]["configured_share"] == pytest.approx(8 / 11, abs=1e-3)
    stats = next(iter(env.app.control.inspect(timeout=2).stats().values()))
    assert stats["prefetch_count"] == 2
    # inspect stats (Flower's worker page): one readable line per tier.
    assert stats["prio realtime"].startswith("wait p99 ") and "share " in stats["prio realtime"]
    assert "done 1" in stats["prio offline"]


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_threads_and_solo_pools(env, pool):
    t = tasks(env)
    env.start_worker(concurrency=2, pool=pool)
    results = [t["t.sleep"].apply_async((f"p{i}", 0.01), tier=i % 3) for i in range(6)]
    assert sorted(r.get(timeout=15) for r in results) == [f"p{i}" for i in range(6)]


def test_bad_messages_are_rejected_and_the_worker_keeps_serving(env):
    t = tasks(env)
    worker = env.start_worker(concurrency=2)
    env.app.send_task("t.not_registered", queue=env.queue(B))
    with env.app.producer_or_acquire() as producer:
        producer.publish(
            b"\x80\x04 not json",
            routing_key=env.queue(B),
            exchange=env.queue(B),
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": "t.noop", "id": "pickled-1"},
        )
    assert t["t.sleep"].apply_async(("after", 0.0), tier="batch").get(timeout=10) == "after"
    env.wait_for(lambda: env.depth(B) == 0, what="bad messages gone from the queue")
    log = worker.log()
    assert "Received unregistered task of type 't.not_registered'" in log
    assert worker.proc.poll() is None


def test_idle_worker_makes_bounded_broker_calls(env):
    from celery_prio.worker.control import collect_prio_stats

    env.start_worker(concurrency=2)

    def calls():
        (prio,) = collect_prio_stats(env.app, timeout=5, limit=1).values()
        return prio["broker_calls"], len(prio["polled_queues"]), time.monotonic()

    time.sleep(1.0)  # its first fetches, right after it started
    before, queues, t0 = calls()
    time.sleep(2.0)
    after, _, t1 = calls()
    if env.settings.get("fetch") == "consume":
        # Pushed tier queues; its sub-queues asked at most once per prio_poll_interval (0.05 s).
        assert (after - before) / (t1 - t0) <= 1.1 * queues / 0.05, (after - before, queues)
        return
    # Idle: it blocks on the broker (Redis: the doorbells; RabbitMQ: consumers) and asks no queue at all.
    assert after - before <= 1, (after - before, queues)
    # Woken at once by the next arrival (a lone realtime task into the idle worker), and idle again after.
    assert env.app.tasks["t.rt_sleep"].delay("lone", 0.0).get(timeout=10) == "lone"
    assert calls()[0] - after <= 4


def test_a_worker_refuses_to_start_with_a_task_of_an_unknown_tier(redis_env):
    worker = redis_env.start_worker(concurrency=1, wait=False, env_extra={"PRIO_TEST_BOGUS_TIER": "1"})
    assert worker.proc.wait(60) != 0
    assert "task 't.bogus': unknown tier 'nope'; valid tiers: realtime|batch|offline" in worker.log()


def test_a_worker_pins_each_pool_process_to_one_gpu_with_prio_gpus(redis_env):
    """Issue 38: GPU pinning is the library's. ``--prio-gpus 0,1`` on any app that called install(): each pool
    process narrows CUDA_VISIBLE_DEVICES to one GPU, round robin, and ``inspect stats`` shows it."""
    env = redis_env
    env.start_worker(concurrency=3, extra_args=["--prio-gpus", "0,1"])
    env.wait_for(lambda: len(_devices(env)) == 3, what="three pool processes to record their GPU")
    devices = _devices(env)
    assert sorted(d["cuda_visible_devices"] for d in devices.values()) == ["0", "0", "1"]  # indexes 0, 1, 2
    assert sorted(d["pool_index"] for d in devices.values()) == [0, 1, 2]
    # The worker's GPUs in its prio_stats and in ``prio status``, the operator's view of the fleet.
    (name, stats), *_ = collect_prio_stats(env.app, timeout=2).items()
    assert stats["gpus"] == ["0", "1"]
    assert f"GPUS {name}: 0,1 (one per pool process, in turn)" in env.prio_cli("status")


def _devices(env) -> dict:
    stats = env.app.control.inspect(timeout=2).stats() or {}
    return next(iter(stats.values()), {}).get("devices", {})


def test_a_bad_prio_gpus_stops_the_worker_naming_it(redis_env):
    worker = redis_env.start_worker(concurrency=1, extra_args=["--prio-gpus", "zero"], wait=False)
    redis_env.wait_for(lambda: worker.proc.poll() is not None, timeout=30, what="the worker to stop")
    assert "--prio-gpus, prio_gpus and CELERY_PRIO_GPUS take GPU numbers like 0,1; got 'zero'" in worker.log()
