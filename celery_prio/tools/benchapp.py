"""The Celery app the benchmark starts workers of, in one of three modes.

BENCH_MODE selects how the same tasks are queued and fetched:
  fifo   - plain Celery, one queue, default prefetch
  native - plain Celery, broker-native priorities, prefetch 1 + acks_late
  native_noprefetch - the same with Celery 5.6's worker_disable_prefetch (Redis only: celery #6500's fix)
  prio   - celery-prio installed (three tier queues, scheduler fetch)
  batches - plain Celery with celery-batches' task class for ``bench.classify_celery_batches`` and what it needs
            (unlimited prefetch); the batch backlog in a queue of its own
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

MODES = ("fifo", "native", "native_noprefetch", "prio", "batches")
#: Batched inference in the benchmark (``--only batching``): as the example app's classify.
BATCH = celery_prio.Batch(max_size=32, max_delay=0.005)
#: What each call after the first adds to a batch of ``bench.work_batched``, as a share of one call's time.
BATCH_CALL_COST = 0.1
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
    elif mode == "batches":
        name = f"{prefix}.fifo"
        app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name), Queue(f"{prefix}.bulk")]
        app.conf.task_default_queue = name
        app.conf.task_routes = {"bench.infer_chunk": {"queue": f"{prefix}.bulk"}}
        app.conf.worker_prefetch_multiplier = 0  # celery-batches buffers what it is sent: unlimited prefetch
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
    if os.environ.get("BENCH_WARM_MODEL") == "1":  # --only batching: no request pays for loading the model
        from celery import signals

        def warm_model(**_: object) -> None:
            from celery_prio.example import predict

            predict.warm_up()

        signals.worker_process_init.connect(warm_model, weak=False)
    recorder = redis.Redis.from_url(record_url)
    key = f"{prefix}:records"

    @app.task(shared=False, name="bench.work")
    def work(tier: str, sent: float, seconds: float) -> None:
        start = time.time()
        if seconds:
            time.sleep(seconds)
        recorder.rpush(key, f"{tier} {sent} {start} {time.time()}")

    def record_calls(rows: list[tuple[str, float, float]]) -> None:
        end = time.time()
        with recorder.pipeline(transaction=False) as pipe:
            for tier, sent, start in rows:
                pipe.rpush(key, f"{tier} {sent} {start} {end}")
            pipe.execute()

    @app.task(shared=False, name="bench.classify", tier="realtime")
    def classify(tier: str, sent: float, image: list) -> int:
        """One online request through the example CNN (``--only batching``)."""
        from celery_prio.example import predict

        start = time.time()
        label = predict.classify(image)["label"]
        record_calls([(tier, sent, start)])
        return label

    @app.task(shared=False, name="bench.classify_batched", tier="realtime", batch=BATCH)
    def classify_batched(calls: list) -> list:
        """The same requests, the waiting ones in one forward pass (``celery_prio.Batch``)."""
        from celery_prio.example import predict

        start = time.time()
        labels = [p["label"] for p in predict.classify_calls([c.args[2] for c in calls])]
        record_calls([(c.args[0], c.args[1], start) for c in calls])
        return labels

    @app.task(shared=False, name="bench.work_batched", tier="realtime", batch=BATCH)
    def work_batched(calls: list) -> list:
        """Realtime calls of ``seconds`` each, batched (``--only surge``): a batch of n runs as a GPU batch
        would, the first call's time and a tenth of it for each call more."""
        start = time.time()
        seconds = max(float(c.args[2]) for c in calls)
        time.sleep(seconds * (1 + BATCH_CALL_COST * (len(calls) - 1)))
        record_calls([(c.args[0], c.args[1], start) for c in calls])
        return [None] * len(calls)

    if mode == "batches" and has_celery_batches():  # the worker's side (its own virtualenv, --batches-python)
        from celery_batches import Batches

        @app.task(
            shared=False, name="bench.classify_celery_batches", base=Batches, flush_every=32, flush_interval=0.005
        )
        def classify_celery_batches(requests: list) -> None:
            """The same requests with celery-batches on plain Celery (what Celery's community offers)."""
            from celery_prio.example import predict

            start = time.time()
            predict.classify_calls([r.args[2] for r in requests])
            record_calls([(r.args[0], r.args[1], start) for r in requests])

    @app.task(shared=False, name="bench.infer_chunk", tier="batch")
    def infer_chunk(tier: str, sent: float, n: int, seed: int) -> None:
        """A batch-tier job: ``n`` generated images through the model in one forward pass."""
        import numpy as np

        from celery_prio.example import predict

        start = time.time()
        predict.forward(np.random.default_rng(seed).integers(0, 17, (n, 8, 8)).astype(np.float32))
        record_calls([(tier, sent, start)])

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


def has_celery_batches() -> bool:
    """celery-batches caps Celery below 5.7, so it often lives in another virtualenv than the bench's client."""
    import importlib.util

    return importlib.util.find_spec("celery_batches") is not None
