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
