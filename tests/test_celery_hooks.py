"""Every patch of Celery's behaviour (``celery_prio/celery_hooks.py``), run on the installed Celery.

CI runs this module on the newest Celery and on the oldest the package allows
(``.ci/run``'s oldest-versions run), so a Celery release that moves what a
patch relies on fails here, by name, before the features built on it do.
Broker-facing patches publish to the real brokers; the worker-side ones run
in real worker processes elsewhere too (named in each test).
"""

from __future__ import annotations

import re

import pytest
from celery import Celery, chain, group
from celery.app import utils as celery_app_utils
from celery.concurrency.solo import TaskPool
from celery.result import AsyncResult, ResultSet

import celery_prio
from celery_prio import celery_hooks, celery_private
from celery_prio.batching import batch_run
from celery_prio.tiers import Tier

pytestmark = pytest.mark.timeout(60)


def test_celery_still_has_the_private_names_it_relies_on():
    """``celery_private.py``: chain(), xstarmap and a group's lazy members are these classes on this Celery."""
    app = Celery("private", set_as_current=False)

    @app.task(shared=False)
    def add(x, y):
        return x + y

    assert isinstance(chain(add.s(1, 2), add.s(3)), celery_private.ChainSignature)
    assert isinstance(add.chunks([(1, 2)] * 4, 2).group().tasks[0], celery_private.MapSignature)
    assert isinstance(group(add.s(i, i) for i in range(3)).tasks, celery_private.LazyMembers)


def test_result_waits_are_wrapped_once_and_keep_celerys_behaviour():
    """1. (The waiting-parent pattern on real workers: tests/test_adoption.py.)"""
    celery_prio.install(Celery("waits", broker="redis://127.0.0.1:6379/13", set_as_current=False))
    celery_hooks.count_result_waits()  # a second time: nothing wrapped twice
    for cls, name in celery_hooks.RESULT_WAITS:
        method = cls.__dict__[name]
        assert getattr(method, celery_hooks.MARK)
        assert not getattr(method.__wrapped__, celery_hooks.MARK, False), f"{cls.__name__}.{name} wrapped twice"
    app = Celery("eager", set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(shared=False)
    def double(x):
        return 2 * x

    assert double.delay(21).get() == 42  # Celery's own get, through the wrapper
    assert ResultSet([double.delay(1), double.delay(2)]).join() == [2, 4]
    assert AsyncResult.get.__wrapped__.__qualname__ == "AsyncResult.get"


def test_a_batched_task_takes_one_call_before_and_after_the_app_is_finalized():
    """2. and 3. (A worker's batches through Celery's tracer: tests/test_batch_canvas.py.)"""
    app = Celery("batched", broker="redis://127.0.0.1:6379/13", set_as_current=False)
    celery_prio.install(app)

    @app.task(shared=False, batch=celery_prio.Batch(max_size=4))
    def square(calls):
        return [c.args[0] ** 2 for c in calls]

    assert square(3) == 9  # one call's arguments, before finalize (Celery._task_from_fun)
    app.finalize()
    assert square(4) == 16
    assert square([celery_prio.Call("a", (2,)), celery_prio.Call("b", (5,))]) == [4, 25]
    assert batch_run(square)([celery_prio.Call("c", (6,))]) == [36]  # the function as written
    celery_hooks.takes_batches(square)  # idempotent
    assert square(7) == 49


def test_a_group_of_one_tiered_task_is_published_through_the_bulk_path(env):
    """4. The ids tell the bulk path (``<base>-<i>``); every member is in the tier's queue."""
    result = group(env.app.tasks["t.sleep"].s(f"g{i}", 0).set(tier="offline") for i in range(60)).apply_async()
    assert len(result.results) == 60
    assert all(re.fullmatch(r".+-\d+", r.id) for r in result.results), result.results[0].id
    assert [r.id.rsplit("-", 1)[1] for r in result.results] == [str(i) for i in range(60)]
    env.wait_for(lambda: env.depth(Tier.OFFLINE) == 60, what="60 messages in offline")


def test_a_chain_lifts_its_steps_to_the_tier_of_its_last_step(env):
    """5. The first step of an offline -> realtime chain is published at realtime (it is published first)."""
    tasks = env.app.tasks
    chain(tasks["t.sleep"].si("first", 0).set(tier="offline"), tasks["t.add"].si(1, 2)).apply_async()
    env.wait_for(lambda: env.depth(Tier.REALTIME) == 1, what="the first step in realtime")
    assert env.depth(Tier.OFFLINE) == 0


def test_send_task_turns_a_rabbitmq_refusal_into_queue_full_naming_the_routed_tier(amqp_env):
    """6. The refusal names the tier the router chose (recorded as it routed: not routed again)."""
    env = amqp_env
    env.configure(max_length={"batch": 1}, sjf=False)
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("a", 0), tier="batch")
    with pytest.raises(celery_prio.QueueFull) as full:
        sleep.apply_async(("b", 0), tier="batch")
    assert full.value.tier is Tier.BATCH and full.value.status_code == 429
    assert getattr(env.app.send_task, celery_hooks.MARK)


def test_a_pool_job_leaving_its_slot_is_heard_once_per_job():
    """7. On Celery's own solo pool (real workers of every pool: tests/test_worker.py): a job that ran is heard
    as ended by its result callback."""
    pool = TaskPool()
    ended: list[object] = []
    results: list[int] = []
    celery_hooks.notify_when_jobs_end(pool, lambda by_result: ended.append(by_result))
    celery_hooks.notify_when_jobs_end(pool, lambda by_result: ended.append("twice"))  # not wrapped again
    pool.apply_async(lambda: 42, callback=results.append)
    assert results == [42] and ended == [True]


def test_a_pool_job_the_pool_lost_is_heard_as_not_ended_by_its_result():
    """7. A job's error callback (the pool lost it: a killed child, a hard time limit) ends its slot too, marked
    so that the worker settles it from its event loop, not inside the pool's error handling."""

    class LosingPool:  # Celery's pools call ``error_callback`` for a lost job; this one loses every job
        def apply_async(self, target, callback=None, error_callback=None, **kwargs):
            error_callback(RuntimeError("child killed"))

    pool = LosingPool()
    ended: list[object] = []
    errors: list[object] = []
    celery_hooks.notify_when_jobs_end(pool, lambda by_result: ended.append(by_result))
    pool.apply_async(lambda: 42, callback=lambda r: None, error_callback=errors.append)
    assert len(errors) == 1 and ended == [False]


def test_only_the_prefork_pool_reports_results_on_the_event_loop():
    """The slot of a job that ended is refilled in its result callback only where that callback runs on the
    event loop's thread from outside the task: prefork. Threads call back from a pool thread; solo from
    inside the fetch loop's own pump (a refill there would recurse)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool
    from celery.concurrency.thread import TaskPool as ThreadPool

    from celery_prio.worker.worker_runtime import results_on_loop

    assert results_on_loop(PreforkPool(limit=1))
    assert not results_on_loop(ThreadPool(limit=1))
    assert not results_on_loop(TaskPool())


def test_inspect_conf_masks_the_management_url():
    """8."""
    celery_prio.install(Celery("masked", broker="redis://127.0.0.1:6379/13", set_as_current=False))
    shown = celery_app_utils.filter_hidden_settings({"prio_management_url": "http://user:secret@rabbit:15672"})
    assert "secret" not in str(shown)
