"""The Celery app the integration tests start real workers of.

``make_app`` builds one app per test (own broker, queue prefix, Redis db).
Worker processes build theirs from the environment: PRIO_TEST_BROKER,
PRIO_TEST_BACKEND, PRIO_TEST_PREFIX, PRIO_TEST_SETTINGS (JSON of install()
overrides), PRIO_TEST_VISIBILITY (Redis visibility timeout) and
PRIO_TEST_PLAIN=1 for a plain Celery app. Tasks log their start and end to
the Redis list ``<prefix>:log`` on the result backend's Redis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

import celery_prio
from celery_prio.runtime import publisher_of

#: Set in a worker's environment: a pool child that publishes a sliced task's continuation kills its worker and
#: itself right after, before the ack (the crash window the slices' exactly-once must survive).
CRASH_AFTER_SLICE_PUBLISH = "PRIO_TEST_CRASH_AFTER_SLICE_PUBLISH"


def _crash_after_slice_publish(app: Celery) -> None:
    import signal

    continuations = publisher_of(app).continuations
    publish = continuations.publish

    def publish_then_crash(continuation: Any) -> None:
        publish(continuation)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    continuations.publish = publish_then_crash


def make_app(
    prefix: str,
    broker: str,
    backend: str,
    settings: dict[str, Any] | None = None,
    visibility_timeout: float = 3600,
    plain: bool = False,
) -> Celery:
    app = Celery("workerapp", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        broker_transport_options={
            "visibility_timeout": visibility_timeout,
            # sentinel:// brokers name the group whose master carries the queues (tests/test_sentinel.py).
            **(
                {"master_name": os.environ.get("PRIO_TEST_SENTINEL_MASTER", "prio-master")}
                if broker.startswith("sentinel")
                else {}
            ),
        },
    )
    if not plain:
        celery_prio.install(app, queue_prefix=prefix, **(settings or {}))
        if os.environ.get(CRASH_AFTER_SLICE_PUBLISH):
            _crash_after_slice_publish(app)
    recorder = redis.Redis.from_url(backend)
    log_key = f"{prefix}:log"

    def record(kind: str, tag: str) -> None:
        recorder.rpush(log_key, json.dumps({"kind": kind, "tag": tag, "t": time.time(), "pid": os.getpid()}))

    @app.task(shared=False, name="t.sleep")
    def sleep(tag: str, seconds: float) -> str:
        record("start", tag)
        time.sleep(seconds)
        record("end", tag)
        return tag

    @app.task(shared=False, name="t.rt_sleep", tier="realtime")
    def rt_sleep(tag: str, seconds: float) -> str:
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.where", bind=True)
    def where(self, *_: Any, tag: str = "", spawn: bool = False) -> str:
        """Logs the queue it was fetched from (no tier of its own); with ``spawn``, publishes a child."""
        record("where", f"{tag}:{(self.request.delivery_info or {}).get('routing_key')}")
        if spawn:
            record("spawn", tag + "-child")  # when the child is published: its own wait starts here
            where.apply_async(kwargs={"tag": tag + "-child"})
        return tag

    @app.task(shared=False, name="t.routed")
    def routed(tag: str, seconds: float) -> str:
        """No tier of its own: tests route it with prio_routes."""
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.rt_short", tier="realtime")
    def rt_short(tag: str, seconds: float) -> str:
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.slow_late", acks_late=True, tier="offline")
    def slow_late(tag: str, seconds: float) -> str:
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.rt_late", acks_late=True, tier="realtime")
    def rt_late(tag: str, seconds: float) -> str:
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.batch_late", acks_late=True, tier="batch")
    def batch_late(tag: str, seconds: float) -> str:
        return sleep(tag, seconds)

    @app.task(shared=False, name="t.flaky", bind=True, max_retries=3, tier="batch")
    def flaky(self, tag: str) -> str:
        record(f"try{self.request.retries}", tag)
        if self.request.retries < 1:
            raise self.retry(countdown=0.5)
        return tag

    @app.task(shared=False, name="t.add", tier="realtime")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(shared=False, name="t.tsum", tier="offline")
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(shared=False, name="t.noop")
    def noop() -> None:
        return None

    def sliced_body(task, tag: str, n: int, seconds: float, start: int, done: list | None) -> list[int]:
        """n elements of ``seconds`` each; returns [i*i for i in range(n)] however often it yields."""
        done = [] if done is None else done
        for i in celery_prio.slices(task, range(start, n), resume="start", carry={"done": done}):
            if i == start:  # this pool process connected for its slice checks as the run began
                record("readied", f"{tag}:{int(publisher_of(app).continuations.readied)}")
            record("el", f"{tag}:{i}")
            time.sleep(seconds)
            done.append(i * i)
        record("done", tag)
        return done

    @app.task(shared=False, name="t.sliced", bind=True, tier="batch", acks_late=True)
    def sliced(self, tag: str, n: int, seconds: float, start: int = 0, done: list | None = None) -> list[int]:
        return sliced_body(self, tag, n, seconds, start, done)

    @app.task(shared=False, name="t.sliced_offline", bind=True, tier="offline", acks_late=True)
    def sliced_offline(self, tag: str, n: int, seconds: float, start: int = 0, done: list | None = None) -> list:
        return sliced_body(self, tag, n, seconds, start, done)

    @app.task(shared=False, name="t.record_sum", tier="batch")
    def record_sum(results: list) -> int:
        record("body", "chord")
        return sum(sum(r) for r in results)

    @app.task(shared=False, name="t.rt_waits", tier="realtime")
    def rt_waits(task_id: str, timeout: float) -> Any:
        """A realtime task that needs a lower-tier task's result (priority inversion without celery_prio.wait)."""
        return celery_prio.wait(app.AsyncResult(task_id), timeout=timeout)

    @app.task(shared=False, name="t.rt_spawn_and_wait", tier="realtime")
    def rt_spawn_and_wait(tag: str, seconds: float, timeout: float) -> Any:
        """Publishes an offline task itself (RabbitMQ boosts from the publishing process), then waits on it."""
        return celery_prio.wait(sleep.apply_async((tag, seconds), tier="offline"), timeout=timeout)

    @app.task(shared=False, name="t.batch_echo", tier="realtime", batch=celery_prio.Batch(max_size=8, max_delay=0.05))
    def batch_echo(calls: list) -> list:
        """``[tag, batch size]`` per call; ``bad`` fails alone, ``short`` returns too few results."""
        record("batch", str(len(calls)))
        out: list = []
        for call in calls:
            tag = call.args[0]
            record("call", tag)
            if tag == "short":
                return []
            out.append(ValueError("bad input") if tag == "bad" else [tag, len(calls)])
        return out

    @app.task(
        shared=False, name="t.batch_slow_fill", tier="realtime", batch=celery_prio.Batch(max_size=4, max_delay=0.3)
    )
    def batch_slow_fill(calls: list) -> list:
        return [[call.args[0], len(calls)] for call in calls]

    @app.task(shared=False, name="t.batched_late", tier="realtime", acks_late=True, batch=celery_prio.Batch(3, 0.05))
    def batched_late(calls: list) -> list:
        """acks_late, 1.5 s a batch: a worker killed mid-batch gives every call back."""
        record("batch", str(len(calls)))
        time.sleep(1.5)
        for call in calls:
            record("call-end", call.args[0])
        return [[call.args[0], len(calls)] for call in calls]

    # -- a batched task inside Celery's canvas (tests/test_batch_canvas.py) ---------------------------------
    @app.task(shared=False, name="t.batch_double", tier="realtime", batch=celery_prio.Batch(max_size=8, max_delay=0.2))
    def batch_double(calls: list) -> list:
        """Each call's number doubled; a negative number fails that call alone; ``"slow"`` takes 3 s."""
        record("batch", str(len(calls)))
        if any(call.args[0] == "slow" for call in calls):
            time.sleep(3)
        return [ValueError(f"negative: {c.args[0]}") if c.args[0] < 0 else c.args[0] * 2 for c in calls]

    @app.task(
        shared=False, name="t.batch_time_limited", tier="realtime", time_limit=1,
        batch=celery_prio.Batch(max_size=4, max_delay=0.05),
    )  # fmt: skip
    def batch_time_limited(calls: list) -> list:
        time.sleep(3)
        return [c.args[0] for c in calls]

    @app.task(
        shared=False, name="t.batch_flaky", tier="realtime", autoretry_for=(ConnectionError,), max_retries=3,
        default_retry_delay=0, retry_backoff=False, batch=celery_prio.Batch(max_size=8, max_delay=0.05),
    )  # fmt: skip
    def batch_flaky(calls: list) -> list:
        """A call tagged ``flaky`` fails its first attempt with a ConnectionError (retried by autoretry_for)."""
        out: list = []
        for call in calls:
            attempt = recorder.incr(f"{prefix}:attempts:{call.args[0]}")
            record("attempt", f"{call.args[0]}:{attempt}")
            out.append(ConnectionError("first try") if call.args[0] == "flaky" and attempt == 1 else call.args[0])
        return out

    @app.task(
        shared=False, name="t.batch_lengths", tier="realtime", batch=celery_prio.Batch(max_size=32, max_delay=0.05)
    )
    def batch_lengths(calls: list) -> list:
        """Each call's argument's length (large arguments: the batch's byte budget)."""
        record("batch", str(len(calls)))
        return [len(c.args[0]) for c in calls]

    @app.task(shared=False, name="t.add_all", tier="batch")
    def add_all(values: list, tag: str = "total") -> int:
        record(tag, str(sum(values)))
        return sum(values)

    @app.task(shared=False, name="t.note")
    def note(value: Any, tag: str) -> Any:
        record(tag, json.dumps(value))
        return value

    @app.task(shared=False, name="t.note_error")
    def note_error(request: Any, exc: Any, traceback: Any) -> None:
        record("errback", f"{request.id}:{exc}")

    def signalled(kind: str) -> Any:
        def receiver(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
            # task_success names no id: the request being traced is the call's
            record(f"signal-{kind}", task_id or getattr(sender.request, "id", None) or "")

        return receiver

    for kind in ("prerun", "postrun", "success", "failure"):
        getattr(signals, f"task_{kind}").connect(signalled(kind), sender=batch_double, weak=False)

    if os.environ.get("PRIO_TEST_BOGUS_TIER") == "1":  # a typo a worker must refuse to start with

        @app.task(shared=False, name="t.bogus", tier="nope")
        def bogus() -> None:
            return None

    return app


def _from_env() -> Celery:
    env = os.environ
    return make_app(
        prefix=env.get("PRIO_TEST_PREFIX", "prio"),
        broker=env.get("PRIO_TEST_BROKER", "redis://127.0.0.1:6379/13"),
        backend=env.get("PRIO_TEST_BACKEND", "redis://127.0.0.1:6379/13"),
        settings=json.loads(env.get("PRIO_TEST_SETTINGS", "{}")),
        visibility_timeout=float(env.get("PRIO_TEST_VISIBILITY", 3600)),
        plain=env.get("PRIO_TEST_PLAIN") == "1",
    )


def __getattr__(name: str) -> Celery:
    # ``celery -A tests.workerapp`` asks for ``app``; built on demand so that
    # importing make_app in the test process creates no stray app.
    if name == "app":
        globals()["app"] = built = _from_env()
        return built
    raise AttributeError(name)
