"""An existing Celery app adopting celery-prio, and the same app plain, as it was before.

``tests/test_adoption.py`` and ``celery-prio bench --only adoption`` start
workers of it. Its shape is what adopters have: a default queue and routes
of its own, a task that waits on its own group, configuration set after
``install()``. Worker processes build it from the environment:

* PRIO_ADOPT_BROKER, PRIO_ADOPT_BACKEND, PRIO_ADOPT_PREFIX (also names the app's own queues);
* PRIO_ADOPT_SETTINGS: JSON of ``install()`` overrides; PRIO_ADOPT_PLAIN=1: plain Celery, no ``install()``;
* PRIO_ADOPT_ROLE: ``a`` (default) or ``b``, two apps on one broker with different tasks;
* PRIO_ADOPT_LATE: ``routes`` (the app's config assigns ``task_routes`` and ``broker_transport_options``
  after ``install()``), ``reload`` (``config_from_object`` after it), ``consumer`` (a consumer of its own).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, group
from celery.worker.consumer import Consumer

import celery_prio


class OwnConsumer(Consumer):
    """A consumer an app set for itself: celery-prio's worker cannot run with it."""


def make_app(
    prefix: str,
    broker: str,
    backend: str,
    settings: dict[str, Any] | None = None,
    plain: bool = False,
    role: str = "a",
    late: str = "",
) -> Celery:
    app = Celery(f"adopt{role}", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        # The app's own default queue and routes, set before install() as an existing app has them.
        task_default_queue=f"{prefix}-celery",
        task_routes={"adopt.own.*": {"queue": f"{prefix}-default"}},
    )
    if not plain:
        celery_prio.install(app, queue_prefix=prefix, **(settings or {}))
    if late == "routes":  # a later config module's assignments
        app.conf.task_routes = {"adopt.own.*": {"queue": f"{prefix}-default"}}
        app.conf.broker_transport_options = {"visibility_timeout": 3600}
    elif late == "reload":
        app.config_from_object({"result_expires": 600, "broker_connection_retry_on_startup": True})
    elif late == "consumer":
        app.conf.worker_consumer = "celery_prio.tools.adoptapp:OwnConsumer"

    @app.task(name=f"adopt.{role}.square", shared=False)
    def square(x: int, seconds: float = 0.05) -> int:
        time.sleep(seconds)
        return x * x

    @app.task(name=f"adopt.{role}.fan_out", bind=True, shared=False)
    def fan_out(self: Any, n: int, seconds: float = 0.05) -> int:
        """Starts a group and waits on it: Celery documents ``disable_sync_subtasks=False`` for this."""
        return sum(group(square.s(i, seconds) for i in range(n))().get(disable_sync_subtasks=False, timeout=120))

    @app.task(name=f"adopt.{role}.wait_one", shared=False)
    def wait_one(x: int) -> int:
        return square.delay(x).get(disable_sync_subtasks=False, timeout=120)

    @app.task(name=f"adopt.{role}.rt", tier="realtime", shared=False)
    def rt(x: int) -> int:
        return x

    @app.task(name=f"adopt.own.{role}.work", shared=False)
    def work(tag: str, seconds: float) -> list[float]:
        started = time.time()
        time.sleep(seconds)
        return [started, time.time()]

    return app


#: The environment a worker process of this app reads (see the module doc).
ENV_PREFIX = "PRIO_ADOPT_"


def worker_env(
    prefix: str,
    broker: str,
    backend: str,
    settings: dict[str, Any] | None = None,
    plain: bool = False,
    role: str = "a",
    late: str = "",
) -> dict[str, str]:
    """The environment of a worker process of this app (``celery -A celery_prio.tools.adoptapp worker``)."""
    return {
        "PRIO_ADOPT_PREFIX": prefix,
        "PRIO_ADOPT_BROKER": broker,
        "PRIO_ADOPT_BACKEND": backend,
        "PRIO_ADOPT_SETTINGS": json.dumps(settings or {}),
        "PRIO_ADOPT_PLAIN": "1" if plain else "",
        "PRIO_ADOPT_ROLE": role,
        "PRIO_ADOPT_LATE": late,
    }


def _from_env() -> Celery:
    return make_app(
        os.environ["PRIO_ADOPT_PREFIX"],
        os.environ["PRIO_ADOPT_BROKER"],
        os.environ["PRIO_ADOPT_BACKEND"],
        json.loads(os.environ.get("PRIO_ADOPT_SETTINGS") or "{}"),
        plain=os.environ.get("PRIO_ADOPT_PLAIN") == "1",
        role=os.environ.get("PRIO_ADOPT_ROLE") or "a",
        late=os.environ.get("PRIO_ADOPT_LATE", ""),
    )


if "PRIO_ADOPT_PREFIX" in os.environ:
    app = _from_env()
