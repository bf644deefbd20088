"""Callers of a batched task are unchanged in every process state: an app not finalized yet, eager mode."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

import celery_prio
from tests.conftest import REDIS_URL, need_broker


def web_app(prefix: str, **conf: Any) -> tuple[Celery, Any]:
    """A publisher as a web app has it: the tasks module imported, no task looked up, nothing finalized."""
    app = Celery("web", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
    app.conf.update(conf)
    celery_prio.install(app, queue_prefix=prefix)

    @app.task(name="web.classify", batch=celery_prio.Batch(max_size=4))
    def classify(calls):
        return [sum(c.args) for c in calls]

    return app, classify


def _clean(app: Celery, prefix: str) -> None:
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        for key in client.scan_iter(f"{prefix}.*"):
            client.delete(key)


def test_a_batched_task_takes_its_callers_arguments_before_the_app_is_finalized():
    """It raised ``TypeError: classify() takes 1 positional argument but 2 were given``."""
    need_broker("redis")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app, classify = web_app(prefix)
    try:
        assert not app.finalized
        result = classify.apply_async((2, 3))
        assert result.id
        assert not app.finalized  # the call did not need the app finalized
        with app.connection_for_write() as conn:
            assert conn.default_channel.client.llen(f"{prefix}.batch.sjf-web-classify") == 1
    finally:
        _clean(app, prefix)


def test_a_batched_task_called_eagerly_before_finalize_gets_a_batch_of_one():
    need_broker("redis")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app, classify = web_app(prefix, task_always_eager=True)
    try:
        assert classify.apply_async((2, 3)).get() == 5
        assert classify.delay(4, 5).get() == 9
        assert classify(1, 1) == 2  # a direct call too
    finally:
        _clean(app, prefix)


def test_a_sub_queue_in_use_is_introduced_again_well_inside_prune_after(redis_env, monkeypatch):
    """A prune pass that found a tenant's sub-queue empty for a moment took it out of the registry; its
    publishers introduced it again only after 24 h, pushing meanwhile to a queue no worker asked."""
    import time as real_time

    from celery_prio.brokers import base
    from celery_prio.brokers.redis.pruning import prune
    from celery_prio.settings import settings_for

    env = redis_env
    env.configure(prune_after=60)
    settings = settings_for(env.app)
    client = env.adapter.client
    queue = f"{env.prefix}.batch.acme"
    sleep = env.app.tasks["t.sleep"]
    sleep.apply_async(("a", 0), tier="batch", subqueue="acme")
    assert client.sismember(settings.subqueue_registry, queue)
    client.delete(queue)  # taken by a worker: the queue is empty for a moment
    client.delete(f"{env.prefix}.prune")  # no pass ran within the lease's interval
    assert prune(client, settings, "w", now=real_time.time() + 61)["subqueues"] == 1
    assert not client.sismember(settings.subqueue_registry, queue)
    later = real_time.monotonic() + 31  # half of prio_prune_after on
    monkeypatch.setattr(base.time, "monotonic", lambda: later)
    sleep.apply_async(("b", 0), tier="batch", subqueue="acme")
    assert client.sismember(settings.subqueue_registry, queue)
