"""Shortest job first inside realtime (issue 13), with real brokers and workers."""

from __future__ import annotations

import threading
import time


def started(env) -> list[str]:
    return [x["tag"] for x in env.log() if x["kind"] == "start"]


def start_times(env) -> dict[str, float]:
    return {x["tag"]: x["t"] for x in env.log() if x["kind"] == "start"}


def test_short_realtime_tasks_go_before_queued_long_ones(env):
    # 0.6 s of long calls queued on one slot: over realtime's wait budget, so no budget (this is about order).
    env.configure(reserve=0, max_wait={"realtime": None})
    env.start_worker(concurrency=1)
    long, short = env.app.tasks["t.rt_sleep"], env.app.tasks["t.rt_short"]
    long.delay("warm-long", 0.2).get(timeout=20)  # run times learnt: 0.2 s and ~0 s
    short.delay("warm-short", 0).get(timeout=20)
    blocker = long.delay("L0", 0.5)
    env.wait_for(lambda: "L0" in started(env), what="the first long task to start")
    for i in range(1, 4):  # queued behind the running one, longs first
        long.delay(f"L{i}", 0.2)
    for i in range(4):
        short.delay(f"S{i}", 0)
    env.wait_for(lambda: len([t for t in started(env) if t[0] in "LS"]) == 8, timeout=30, what="all tasks")
    order = [t for t in started(env) if t[0] in "LS" and t != "L0"]
    assert order[:4] == ["S0", "S1", "S2", "S3"], order  # FIFO in the tier would start L1..L3 first
    blocker.get(timeout=10)


def test_a_long_task_is_not_starved_past_the_bound(env):
    """Shorts arrive faster than one slot runs them; each long still starts within about prio_sjf_max_wait."""
    # No wait budget: the flood must stay in the queue (admission would refuse most of it, as it should).
    env.configure(reserve=0, sjf_max_wait=0.3, max_wait={"realtime": None})
    env.start_worker(concurrency=1)
    long, short = env.app.tasks["t.rt_sleep"], env.app.tasks["t.rt_short"]
    long.delay("warm-long", 0.1).get(timeout=20)
    short.delay("warm-short", 0.02).get(timeout=20)
    stop = threading.Event()

    def flood() -> None:
        i = 0
        while not stop.is_set():
            short.delay(f"s{i}", 0.02)
            i += 1
            time.sleep(0.01)  # 100/s of 20 ms tasks on one slot: the short queue never empties

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        sent = {}
        for i in range(3):
            sent[f"L{i}"] = time.time()
            long.delay(f"L{i}", 0.1)
            time.sleep(0.8)
        env.wait_for(lambda: all(t in start_times(env) for t in sent), timeout=10, what="the long tasks")
    finally:
        stop.set()
        thread.join(5)
    waits = {tag: start_times(env)[tag] - at for tag, at in sent.items()}
    assert max(waits.values()) < 1.0, waits  # unbounded SJF would run them only after the flood


def test_a_shortest_first_queue_declared_with_other_arguments_does_not_stop_the_worker(amqp_env):
    """RabbitMQ closes a channel on PRECONDITION_FAILED: the worker goes on with a new one and serves."""
    env = amqp_env
    queue = f"{env.prefix}.realtime.sjf-t-rt_short"
    with env.app.connection_for_write() as conn:
        conn.default_channel.queue_declare(queue=queue, durable=True, auto_delete=False, arguments={"x-max-length": 7})
    worker = env.start_worker(concurrency=1)
    assert env.app.tasks["t.rt_short"].delay("after", 0).get(timeout=20) == "after"
    assert env.app.tasks["t.sleep"].delay("batch", 0).get(timeout=20) == "batch"
    assert "exists with other arguments" in worker.log()
