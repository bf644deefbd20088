"""Dynamic batching (issue 29): one run of a batched task serves many waiting calls.

Pure checks of ``Batch`` and of what a batch's outcomes are; then real brokers
and real workers: results per id in the order of the requests, one bad request
failing alone, the size bound, the delay bound, revoked ids skipped, a worker
killed mid-batch (``acks_late``) losing and doubling nothing, and batch sizes
in the worker's report.
"""

from __future__ import annotations

import time

import pytest
from celery.exceptions import TaskRevokedError

import celery_prio
from celery_prio.batching import BatchResultError, Call, results_of
from celery_prio.worker.control import collect_prio_stats


# -- pure ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_size": 0}, "max_size"),
        ({"max_size": 2.5}, "max_size"),
        ({"max_size": True}, "max_size"),
        ({"max_delay": -1}, "max_delay"),
        ({"max_delay": float("nan")}, "max_delay"),
        ({"max_delay": "5ms"}, "max_delay"),
    ],
)
def test_a_bad_batch_names_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        celery_prio.Batch(**kwargs)


def test_a_batchs_outcomes_are_one_per_call():
    calls = [Call(f"id{i}", (i,)) for i in range(3)]
    assert results_of(lambda cs: [c.args[0] * 2 for c in cs], calls, "t") == [0, 2, 4]
    bad = ValueError("bad input")
    assert results_of(lambda cs: [1, bad, 3], calls, "t") == [1, bad, 3]  # that call fails, alone
    boom = RuntimeError("the model crashed")

    def crash(cs):
        raise boom

    assert results_of(crash, calls, "t") == [boom] * 3  # the whole call failed: every call fails
    wrong = results_of(lambda cs: [1, 2], calls, "t")
    assert all(isinstance(o, BatchResultError) for o in wrong) and "2 results for 3 calls" in str(wrong[0])
    assert isinstance(results_of(lambda cs: "abc", calls, "t")[0], BatchResultError)


def test_a_batched_task_called_directly_gets_a_batch_of_one(redis_env):
    task = redis_env.app.tasks["t.batch_echo"]
    assert task("x") == ["x", 1]
    assert task.run([Call("a", ("y",)), Call("b", ("z",))]) == [["y", 2], ["z", 2]]


# -- real brokers and workers ----------------------------------------------------------------------------------
def sizes(env) -> list[int]:
    return [int(x["tag"]) for x in env.log() if x["kind"] == "batch"]


def hold_the_slot(env, seconds: float) -> None:
    """Keep the worker's only slot busy so that calls queue up behind it (then they are taken as batches)."""
    env.app.tasks["t.rt_sleep"].delay("hold", seconds)
    env.wait_for(lambda: any(x["tag"] == "hold" and x["kind"] == "start" for x in env.log()), what="the hold")


def test_results_per_id_in_the_order_of_the_requests(env):
    env.start_worker(concurrency=1)
    hold_the_slot(env, 1.0)
    echo = env.app.tasks["t.batch_echo"]
    results = [echo.delay(f"r{i}") for i in range(20)]
    assert [r.get(timeout=20)[0] for r in results] == [f"r{i}" for i in range(20)]
    ran = sizes(env)
    assert sum(ran) == 20 and max(ran) <= 8 and max(ran) > 1, ran  # batched, never over max_size
    assert env.depth(celery_prio.Tier.REALTIME) == 0


def test_one_bad_request_fails_alone(env):
    env.start_worker(concurrency=1)
    hold_the_slot(env, 1.0)
    echo = env.app.tasks["t.batch_echo"]
    results = [echo.delay(tag) for tag in ("a", "bad", "c")]
    assert results[0].get(timeout=20)[0] == "a" and results[2].get(timeout=20)[0] == "c"
    with pytest.raises(ValueError, match="bad input"):
        results[1].get(timeout=20)
    assert max(sizes(env)) == 3  # one batch: the bad call failed inside it


def test_a_wrong_length_fails_every_call_with_a_clear_error(redis_env):
    env = redis_env
    env.start_worker(concurrency=1)
    with pytest.raises(BatchResultError, match="returned 0 results for 1 calls"):
        env.app.tasks["t.batch_echo"].delay("short").get(timeout=20)


def test_a_lone_request_waits_no_more_than_max_delay_beyond_a_free_slot(env):
    env.start_worker(concurrency=2)
    lone = env.app.tasks["t.batch_slow_fill"]  # max_delay 0.3 s
    assert lone.delay("warm").get(timeout=20)
    t0 = time.time()
    assert lone.delay("lone").get(timeout=20)[0] == "lone"
    assert time.time() - t0 < 0.3 + 0.5  # the delay bound plus a round trip and the pool hand-off


def test_revoked_ids_are_skipped(env):
    env.start_worker(concurrency=1)
    hold_the_slot(env, 1.5)
    echo = env.app.tasks["t.batch_echo"]
    results = [echo.delay(f"v{i}") for i in range(4)]
    results[1].revoke()
    time.sleep(0.3)  # the worker hears of the revoke before the slot frees
    assert [results[i].get(timeout=20)[0] for i in (0, 2, 3)] == ["v0", "v2", "v3"]
    with pytest.raises(TaskRevokedError):
        results[1].get(timeout=5)
    assert "v1" not in [x["tag"] for x in env.log() if x["kind"] == "call"]


def test_a_batch_called_in_another_tier_is_batched_there(env):
    env.start_worker(concurrency=2)
    hold = env.app.tasks["t.sleep"]
    hold.apply_async(("hold-b", 1.0), tier="batch")  # with reserve 1: batch's only slot
    env.wait_for(lambda: any(x["tag"] == "hold-b" for x in env.log()), what="the batch hold")
    echo = env.app.tasks["t.batch_echo"]
    results = [echo.apply_async((f"b{i}",), tier="batch") for i in range(6)]
    assert [r.get(timeout=20)[0] for r in results] == [f"b{i}" for i in range(6)]
    assert max(sizes(env)) > 1


def test_a_worker_killed_mid_batch_loses_and_doubles_nothing(env):
    worker = env.start_worker(concurrency=1)
    hold_the_slot(env, 0.5)
    late = env.app.tasks["t.batched_late"]  # acks_late, 1.5 s per batch
    results = [late.delay(f"k{i}") for i in range(6)]
    env.wait_for(lambda: any(x["kind"] == "batch" for x in env.log()), what="a batch to start")
    worker.kill()  # SIGKILL, mid-batch: nothing of that batch was acked
    env.start_worker(concurrency=1)
    assert sorted(r.get(timeout=40)[0] for r in results) == [f"k{i}" for i in range(6)]
    ends = [x["tag"] for x in env.log() if x["kind"] == "call-end"]
    assert sorted(ends) == [f"k{i}" for i in range(6)]  # each completed exactly once


def test_batch_sizes_are_reported(env):
    env.start_worker(concurrency=1)
    hold_the_slot(env, 1.0)
    echo = env.app.tasks["t.batch_echo"]
    [r.get(timeout=20) for r in [echo.delay(f"s{i}") for i in range(10)]]
    (report,) = collect_prio_stats(env.app, timeout=2, limit=1).values()
    batches = report["tiers"]["realtime"]["batches"]
    assert batches["calls"] == 10 and batches["runs"] < 10 and batches["max"] <= 8, batches
