"""An existing Celery app adopts celery-prio without a surprise (real brokers, real workers).

The app is ``celery_prio.tools.adoptapp``.

Each test runs the app's own pattern, the way its README would have it:
a task waiting on its own group, a worker serving only the app's queue,
configuration set after ``install()``, a rolling deploy, two apps on one
broker. On RabbitMQ also with the management API at a closed port.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_prio import QueueFull
from celery_prio.tiers import Tier
from celery_prio.tools.adoptapp import make_app, worker_env
from celery_prio.tools.workers import WorkerProcess
from tests.conftest import ROOT

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def adopt_app(env, role: str = "a", late: str = "", plain: bool = False, **settings: Any):
    merged = {**env.base_settings, **settings}
    return make_app(env.prefix, env.broker, env.backend, merged, plain=plain, role=role, late=late)


def start(env, *, role: str = "a", late: str = "", plain: bool = False, wait: bool = True, **kwargs: Any):
    """A real worker of the adopting app (``kwargs``: WorkerProcess's, e.g. ``queues``, ``concurrency``)."""
    settings = {**env.base_settings, **kwargs.pop("settings", {})}
    n = len(env.workers)
    worker = WorkerProcess(
        "celery_prio.tools.adoptapp",
        log_path=env.tmp_path / f"adopt{n}.log",
        hostname=f"a{n}-{env.prefix}@%h",
        env={**env.worker_env(), **worker_env(env.prefix, env.broker, env.backend, settings, plain, role, late)},
        cwd=ROOT,
        **{"concurrency": 2, **kwargs},
    )
    env.workers.append(worker)
    return worker.wait_ready() if wait else worker


@pytest.mark.parametrize("reserve", [None, 0])
def test_a_task_waiting_on_its_own_group_finishes(stock_env, reserve):
    """Plain Celery -c 2 runs the children in the other slot; celery-prio held it for realtime (reserve) or kept
    a cold batch tier at one slot, and the parent waited for ever."""
    env = stock_env
    settings = {} if reserve is None else {"reserve": reserve}
    app = adopt_app(env, **settings)
    worker = start(env, concurrency=2, settings=settings)
    assert app.tasks["adopt.a.fan_out"].delay(4).get(timeout=30) == 0 + 1 + 4 + 9
    assert app.tasks["adopt.a.wait_one"].delay(5).get(timeout=30) == 25
    # The slot it held while waiting counts again once it returns: realtime keeps its reserve after.
    assert app.tasks["adopt.a.rt"].delay(7).get(timeout=10) == 7
    assert "Traceback" not in worker.log()


def test_a_waiting_task_keeps_realtime_first_once_its_children_finish(redis_env):
    """The blocked parent lets batch into the reserve only while it waits, and the board forgets it after."""
    env = redis_env
    app = adopt_app(env)
    start(env, concurrency=3)
    parent = app.tasks["adopt.a.fan_out"].delay(6, 0.2)
    assert parent.get(timeout=30) == sum(i * i for i in range(6))
    started = time.monotonic()
    assert app.tasks["adopt.a.rt"].delay(1).get(timeout=10) == 1
    assert time.monotonic() - started < 2.0


def test_a_worker_serving_only_the_apps_own_queue_holds_no_slot_for_realtime(stock_env):
    """``task_routes`` -> the app's queue, ``-Q`` that queue, ``-c 2``: both slots run the app's work."""
    env = stock_env
    app = adopt_app(env)
    worker = start(env, concurrency=2, queues=[f"{env.prefix}-default"])
    work = app.tasks["adopt.own.a.work"]
    first, second = (work.delay(f"w{i}", 1.0) for i in range(2))
    (s1, e1), (s2, e2) = first.get(timeout=30), second.get(timeout=30)
    assert max(s1, s2) < min(e1, e2), "the two tasks ran one after the other: a slot was held back"
    assert "no slot held back: this worker serves no realtime queue" in worker.log()


def test_an_idle_worker_of_the_apps_own_queue_takes_a_new_task_at_once(stock_env):
    """On Redis an idle worker blocks on its tiers' doorbells: a publish to the app's own queue rings the default
    tier's (before, it was seen only at the bell's 1 s timeout)."""
    env = stock_env
    app = adopt_app(env)
    start(env, concurrency=2, queues=[f"{env.prefix}-default"])
    work = app.tasks["adopt.own.a.work"]
    work.delay("warm", 0).get(timeout=15)
    waits = []
    for i in range(3):
        time.sleep(1.5)  # idle: blocked on the broker
        sent = time.time()
        started, _ = work.delay(f"w{i}", 0).get(timeout=15)
        waits.append(started - sent)
    assert max(waits) < 0.5, waits


def test_a_worker_that_serves_realtime_says_why_it_holds_a_slot(redis_env):
    worker = start(redis_env, concurrency=4)
    assert "1 of 4 held for realtime arrivals (prio_reserve): batch and offline run in at most 3" in worker.log()
    assert "install() changed this app's configuration" in worker.log()
    assert f"task_default_queue '{redis_env.prefix}-celery' -> '{redis_env.prefix}.batch'" in worker.log()


@pytest.mark.parametrize("late", ["routes", "reload"])
def test_configuration_set_after_install_does_not_undo_it(stock_env, late, caplog):
    """``install(max_length=...)``, then the app's later config replaces task_routes and the transport options
    (or reloads the whole config): the tier router and the cap still hold, and the log names what was replaced."""
    env = stock_env
    caplog.set_level(logging.WARNING, logger="celery_prio.install")
    app = adopt_app(env, late=late, max_length={"realtime": 2})
    rt = app.tasks["adopt.a.rt"]
    accepted, refused = [], 0
    for i in range(5):
        try:
            accepted.append(rt.delay(i))
        except QueueFull:
            refused += 1
    assert (len(accepted), refused) == (2, 3)
    assert env.depth(Tier.REALTIME) == 2
    replaced = "app.conf.task_routes" if late == "routes" else "app.conf.worker_consumer"
    assert any(replaced in r.getMessage() and "replaced after" in r.getMessage() for r in caplog.records)
    # The app's own route still applies to its own tasks: in front of it only the tier router.
    app.tasks["adopt.own.a.work"].delay("own", 0)
    assert env.adapter.depth(f"{env.prefix}-default") == 1
    start(env, late=late, settings={"max_length": {"realtime": 2}})
    assert [r.get(timeout=15) for r in accepted] == [0, 1]


def test_a_worker_refuses_a_consumer_set_after_install_and_names_the_setting(redis_env):
    worker = start(redis_env, late="consumer", wait=False)
    with pytest.raises(RuntimeError) as failed:
        worker.wait_ready(timeout=60)
    named = "worker_consumer is set to 'celery_prio.tools.adoptapp:OwnConsumer' after celery_prio.install()"
    assert named in str(failed.value)


def test_a_rolling_deploy_drains_the_old_default_queue(stock_env):
    """An un-upgraded producer (plain Celery) leaves work in the app's old default queue; an upgraded worker
    started as the README says runs it, and ``prio status`` shows it while it waits."""
    env = stock_env
    old = adopt_app(env, plain=True)
    results = [old.tasks["adopt.a.square"].delay(i, 0) for i in range(3)]
    old_queue = f"{env.prefix}-celery"
    # A plain producer does not wait for RabbitMQ's confirm: the depth is read once all three are in.
    env.wait_for(lambda: env.adapter.depth(old_queue) == 3, timeout=10, what="the old producer's three messages")
    worker = start(env)
    assert [r.get(timeout=30) for r in results] == [0, 1, 4]
    assert "draining it as batch while it has messages (prio_legacy_queues)" in worker.log()
    status = env.prio_cli("status")
    assert "sjf-celery" not in status, "never-used per-task queues of Celery's built-ins are not listed"
    # Drained: asked no more; new work from an old producer is still picked up (checked every few seconds).
    late = old.tasks["adopt.a.square"].delay(5, 0)
    assert late.get(timeout=30) == 25


def test_prio_status_shows_the_old_default_queue_while_it_holds_work(redis_env):
    env = redis_env
    env.configure(legacy_queues=[f"{env.prefix}-celery"])
    old = adopt_app(env, plain=True)
    old.tasks["adopt.a.square"].delay(2, 0)
    data = json.loads(env.prio_cli("status", "--json"))
    assert data["legacy"] == {f"{env.prefix}-celery": {"depth": 1}}
    assert f"LEGACY {env.prefix}-celery: 1 waiting" in env.prio_cli("status")


def test_apps_sharing_a_broker_keep_their_tasks_apart(stock_env):
    """App a's worker (no -Q, as the README says) never takes app b's realtime calls, and moves b's batch calls
    to b's own task queue instead of dead-lettering them as unregistered; b's worker then runs them all."""
    env = stock_env
    b = adopt_app(env, role="b")
    start(env, role="b").stop()  # b's fleet has run here before: the broker's task directory knows its tasks
    worker_a = start(env, role="a")
    a = adopt_app(env, role="a")
    assert a.tasks["adopt.a.rt"].delay(1).get(timeout=15) == 1
    # It waits for b's worker on purpose, past realtime's default deadline: its own expires= keeps it.
    rt_b = b.tasks["adopt.b.rt"].apply_async((2,), expires=120)
    batch_b = b.tasks["adopt.b.square"].delay(3, 0)
    with pytest.raises(CeleryTimeout):
        rt_b.get(timeout=3)
    env.wait_for(lambda: "is not registered on this worker; moved" in worker_a.log(), what="b's call moved")
    assert env.adapter.depth(f"{env.prefix}.dead") == 0
    assert env.adapter.depth(f"{env.prefix}.batch.sjf-adopt-b-square") == 1
    start(env, role="b")
    assert rt_b.get(timeout=30) == 2
    assert batch_b.get(timeout=30) == 9
    assert env.adapter.depth(f"{env.prefix}.dead") == 0


def test_a_task_no_worker_ever_registered_is_dead_lettered_as_before(redis_env):
    """Bad input stays bad input: a name nobody's worker registered is not given a queue of its own."""
    env = redis_env
    b = adopt_app(env, role="b")
    worker = start(env, role="a")
    b.tasks["adopt.b.square"].delay(3, 0)
    env.wait_for(lambda: env.adapter.depth(f"{env.prefix}.dead") == 1, what="the call dead-lettered")
    assert "Received unregistered task of type 'adopt.b.square'" in worker.log()
    assert env.adapter.depth(f"{env.prefix}.batch.sjf-adopt-b-square") == 0
