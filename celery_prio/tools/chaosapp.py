"""The Celery app the chaos run starts workers of (``celery_prio.tools.chaos``).

Every task records what happened to it (``kind tag worker time``) in a Redis
list outside the broker, so the record survives the broker's restart and the
run can tell "completed once" from "run twice after its worker was killed".
Configured from the environment: CHAOS_BROKER, CHAOS_BACKEND, CHAOS_RECORD,
CHAOS_PREFIX and CHAOS_SETTINGS (JSON of ``install()`` settings).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, chord, signals

import celery_prio


def make_app(broker: str, backend: str, record_url: str, prefix: str, settings: dict[str, Any]) -> Celery:
    app = Celery(f"chaos-{prefix}", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        task_acks_late=True,  # every accepted task completes even when its worker is killed mid-run
        result_expires=3600,
        # A worker's own publishes (a chord's body, published by the worker that ends its last header call) ride
        # out the run's broker restart (1 s down) and failover (1.5 s of refused writes): Celery's default policy
        # gives up after about 0.6 s, and a chord body it could not publish is marked failed, never run.
        task_publish_retry_policy=OUTAGE_RETRY_POLICY,
    )
    celery_prio.install(app, queue_prefix=prefix, **settings)
    recorder = redis.Redis.from_url(record_url)
    key = f"{prefix}:chaos"

    def record(kind: str, tag: str, request: Any) -> None:
        recorder.rpush(key, json.dumps({"kind": kind, "tag": tag, "worker": request.hostname, "t": time.time()}))

    @app.task(shared=False, name="chaos.work", bind=True)
    def work(self, tag: str, seconds: float) -> str:
        record("start", tag, self.request)
        time.sleep(seconds)
        record("end", tag, self.request)
        return tag

    @app.task(shared=False, name="chaos.long", bind=True, tier="offline")
    def long(self, tag: str, seconds: float) -> str:
        """A long task: on a ``-P solo`` worker it blocks the event loop (and so the housekeeper lease) meanwhile."""
        record("start", tag, self.request)
        time.sleep(seconds)
        record("end", tag, self.request)
        return tag

    @app.task(
        shared=False, name="chaos.batched", tier="realtime", batch=celery_prio.Batch(max_size=8, max_delay=0.01)
    )  # fmt: skip
    def batched(calls: list) -> list:
        """A chord's header calls, run in batches (the batched path under kills and the broker's faults)."""
        node = _Node(os.environ.get(NODE_ENV, ""))
        for call in calls:
            record("start", call.args[0], node)
        time.sleep(0.05)
        for call in calls:
            record("end", call.args[0], node)
        return [call.args[0] for call in calls]

    @app.task(shared=False, name="chaos.join", bind=True, tier="batch")
    def join(self, parts: list, tag: str) -> int:
        """A chord's body."""
        record("start", tag, self.request)
        record("end", tag, self.request)
        return len(parts)

    def chord_of_batched(tag: str, size: int) -> tuple[list[str], Any]:
        """Publish a chord of ``size`` batched calls and a body: the tags the run waits to see end, and the body."""
        parts = [f"{tag}-{i}" for i in range(size)]
        # The header's calls are realtime: a kill can delay one past realtime's deadline, and a chord with an
        # expired member never runs its body. Their own expires= keeps them (plain realtime calls keep the
        # default deadline, and the run accounts for those that expire).
        body = chord([batched.s(p).set(expires=3600) for p in parts])(join.s(tag))
        return [*parts, tag], body

    app.chaos_chord = chord_of_batched  # type: ignore[attr-defined]

    @app.task(shared=False, name="chaos.sliced", bind=True, tier="batch")
    def sliced(self, tag: str, n: int, seconds: float, start: int = 0, done: list | None = None) -> list[int]:
        done = [] if done is None else done
        if start == 0:
            record("start", tag, self.request)
        for i in celery_prio.slices(self, range(start, n), resume="start", carry={"done": done}):
            time.sleep(seconds)
            done.append(i)
        record("end", tag, self.request)
        return done

    return app


#: Retries at 0, 0.5, 1, 1, ... s: about 8 s, past the run's longest outage (a broker restart, a failover).
OUTAGE_RETRY_POLICY = {"max_retries": 10, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}

#: The worker's node name, for pool processes (a batched task's function runs outside any request).
NODE_ENV = "CHAOS_NODE"


class _Node:
    def __init__(self, hostname: str) -> None:
        self.hostname = hostname


@signals.celeryd_init.connect(weak=False)
def _remember_node(sender: Any = None, **_: Any) -> None:
    os.environ[NODE_ENV] = str(sender or "")  # before the pool forks: its processes inherit it


def _from_env() -> Celery:
    return make_app(
        os.environ["CHAOS_BROKER"],
        os.environ["CHAOS_BACKEND"],
        os.environ["CHAOS_RECORD"],
        os.environ["CHAOS_PREFIX"],
        json.loads(os.environ.get("CHAOS_SETTINGS") or "{}"),
    )


def __getattr__(name: str) -> Celery:
    if name == "app":  # ``celery -A celery_prio.tools.chaosapp worker``
        globals()["app"] = built = _from_env()
        return built
    raise AttributeError(name)
