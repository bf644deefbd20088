"""The Celery app the benchmark starts workers of, in one of three modes.

BENCH_MODE selects how the same tasks are queued and fetched:
  fifo   - plain Celery, one queue, default prefetch
  native - plain Celery, broker-native priorities, prefetch 1 + acks_late
  native_noprefetch - the same with Celery 5.6's worker_disable_prefetch (Redis only: celery #6500's fix)
  prio   - celery-prio installed (three tier queues, scheduler fetch)
Tasks sleep for the given time (standing in for GPU time) and append
``tier sent start end`` to a Redis list, from which the benchmark computes
latency, throughput and progress.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from kombu import Exchange, Queue

import celery_prio

MODES = ("fifo", "native", "native_noprefetch", "prio")
# Broker-native priority values per tier. RabbitMQ: higher is more urgent;
# kombu's Redis emulation polls priority 0 first, so lower is more urgent.
NATIVE_PRIORITY = {
    "amqp": {"realtime": 9, "batch": 5, "offline": 0},
    "redis": {"realtime": 0, "batch": 5, "offline": 9},
}


def make_app(
    mode: str,
    broker: str,
    prefix: str,
    record_url: str,
    confirm: bool = False,
    transport_options: dict | None = None,
    **prio_settings,
) -> Celery:
    if mode not in MODES:
        raise ValueError(f"unknown benchmark mode {mode!r}; valid: {', '.join(MODES)}")
    app = Celery(f"bench-{mode}", broker=broker, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
        worker_redirect_stdouts=False,
    )
    if transport_options:  # e.g. Redis: when kombu brings back a message whose worker is gone
        app.conf.broker_transport_options = dict(transport_options)
    if mode == "prio":
        celery_prio.install(app, queue_prefix=prefix, **prio_settings)
    else:
        name = f"{prefix}.fifo"
        native = mode.startswith("native")
        args = {"x-max-priority": 10} if native else None
        app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name, queue_arguments=args)]
        app.conf.task_default_queue = name
        if confirm:  # plain Celery with publisher confirms: the baseline for RabbitMQ admission
            app.conf.broker_transport_options = {**app.conf.broker_transport_options, "confirm_publish": True}
        if native:
            app.conf.worker_prefetch_multiplier = 1
            app.conf.task_acks_late = True
        if mode == "native_noprefetch":
            app.conf.worker_disable_prefetch = True  # fetch only while a pool slot is free
    recorder = redis.Redis.from_url(record_url)
    key = f"{prefix}:records"

    @app.task(shared=False, name="bench.work")
    def work(tier: str, sent: float, seconds: float) -> None:
        start = time.time()
        if seconds:
            time.sleep(seconds)
        recorder.rpush(key, f"{tier} {sent} {start} {time.time()}")

    # The same work under a second name: shortest-job-first tells tasks apart by name.
    app.task(shared=False, name="bench.work_long")(work.run)

    @app.task(shared=False, name="bench.work_late", acks_late=True)
    def work_late(label: str, seconds: float) -> None:
        """Acknowledged when done: a worker killed mid-run leaves it to come back (the recovery figure)."""
        recorder.rpush(f"{prefix}:starts", f"{label} {time.time()} {os.getpid()}")
        time.sleep(seconds)

    def sliced(self, tier: str, sent: float, elements: int, element_seconds: float, start: int = 0) -> None:
        """GPU work cut into elements; under celery-prio it may yield between them (plain Celery: runs through)."""
        for _ in celery_prio.slices(self, range(start, elements), resume="start"):
            began = time.time()
            time.sleep(element_seconds)
            recorder.rpush(key, f"{tier}-item {sent} {began} {time.time()}")

    app.task(shared=False, name="bench.sliced", bind=True)(sliced)
    # The same work with its tier on the decorator (``@app.task(tier=...)``), as an app would declare it;
    # plain Celery ignores the option.
    for tier in ("realtime", "batch", "offline"):
        app.task(shared=False, name=f"bench.work_{tier}", tier=tier)(work.run)
        app.task(shared=False, name=f"bench.sliced_{tier}", bind=True, tier=tier)(sliced)
    return app


def __getattr__(name: str) -> Celery:
    # ``celery -A celery_prio.tools.benchapp worker`` asks for ``app``.
    if name == "app":
        env = os.environ
        options = json.loads(env.get("BENCH_OPTIONS") or "{}")
        built = make_app(env["BENCH_MODE"], env["BENCH_BROKER"], env["BENCH_PREFIX"], env["BENCH_RECORD"], **options)
        globals()["app"] = built
        return built
    raise AttributeError(name)
