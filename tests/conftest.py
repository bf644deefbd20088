"""Fixtures for tests that talk to real Redis / RabbitMQ and real workers.

Each test gets its own queue prefix; Redis data lives in a dedicated db
(PRIO_TEST_REDIS_DB, default 13) that is flushed before and after the run.
A missing broker skips those tests locally and fails the run under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_prio.brokers import adapter_for
from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS, Tier
from celery_prio.tools.workers import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.workerapp import make_app  # noqa: E402

REDIS_DB = int(os.environ.get("PRIO_TEST_REDIS_DB", "13"))
REDIS_URL = os.environ.get("PRIO_TEST_REDIS", f"redis://127.0.0.1:6379/{REDIS_DB}")
AMQP_URL = os.environ.get("PRIO_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
BROKERS = {"redis": REDIS_URL, "amqp": AMQP_URL}


def _reachable(url: str) -> bool:
    from kombu.utils.url import url_to_parts

    parts = url_to_parts(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), timeout=2):
            return True
    except OSError:
        return False


def need_broker(kind: str) -> None:
    if not _reachable(BROKERS[kind]):
        message = f"{kind} broker not reachable at {BROKERS[kind]}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: a missing broker fails the run)", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def _clean_test_db():
    if _reachable(REDIS_URL):
        redis.Redis.from_url(REDIS_URL).flushdb()
    yield
    if _reachable(REDIS_URL):
        redis.Redis.from_url(REDIS_URL).flushdb()


#: ``prio_boost_key`` of the test apps (a guest broker URL derives none).
TEST_BOOST_KEY = "celery-prio-test-boost-key"


class PrioEnv:
    """One test's broker, queue prefix, client app and workers."""

    def __init__(
        self, kind: str, tmp_path: Path, broker: str | None = None, base_settings: dict[str, Any] | None = None
    ) -> None:
        self.kind = kind
        # Under every configure() (e.g. prio_fetch). Boost on RabbitMQ needs a key when the broker URL is the
        # well-known guest one, as here (tests/test_boost_signing.py covers the default: boosts refused).
        # Realtime calls wait in backlogs here by design (shares, floors, recovery): no deadline unless a test
        # asks (tests/test_admission.py covers the deadline, its default included).
        self.base_settings = {"boost_key": TEST_BOOST_KEY, "realtime_deadline": 0, **(base_settings or {})}
        self.prefix = f"t{uuid.uuid4().hex[:10]}"
        self.broker = broker or BROKERS[kind]
        self.backend = REDIS_URL
        self.tmp_path = tmp_path
        self.workers: list[WorkerProcess] = []
        self.settings: dict[str, Any] = dict(self.base_settings)
        self.visibility_timeout = 3600.0
        self.app = make_app(self.prefix, self.broker, self.backend, self.settings)
        self.recorder = redis.Redis.from_url(self.backend)
        self.adapter = adapter_for(self.app)

    def configure(self, visibility_timeout: float | None = None, **settings: Any) -> None:
        """Re-create the client app with install() overrides (before starting workers)."""
        self.settings = {**self.base_settings, **settings}
        if visibility_timeout is not None:
            self.visibility_timeout = visibility_timeout
        self.app = make_app(self.prefix, self.broker, self.backend, self.settings, self.visibility_timeout)

    def queue(self, tier: Tier) -> str:
        return f"{self.prefix}.{tier.label}"

    def worker_env(self) -> dict[str, str]:
        return {
            "PRIO_TEST_PREFIX": self.prefix,
            "PRIO_TEST_BROKER": self.broker,
            "PRIO_TEST_BACKEND": self.backend,
            "PRIO_TEST_SETTINGS": json.dumps(self.settings),
            "PRIO_TEST_VISIBILITY": str(self.visibility_timeout),
            "PYTHONPATH": str(ROOT),
        }

    def start_worker(
        self,
        concurrency: int = 4,
        wait: bool = True,
        env_extra: dict[str, str] | None = None,
        hostname: str | None = None,
        **kwargs: Any,
    ) -> WorkerProcess:
        """A real worker; ``hostname`` gives it a node name (default: one of its own per worker)."""
        n = len(self.workers)
        worker = WorkerProcess(
            "tests.workerapp",
            log_path=self.tmp_path / f"worker{n}.log",
            concurrency=concurrency,
            hostname=hostname or f"w{n}-{self.prefix}@%h",
            env={**self.worker_env(), **(env_extra or {})},
            cwd=ROOT,
            **kwargs,
        )
        self.workers.append(worker)
        return worker.wait_ready() if wait else worker

    def log(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.recorder.lrange(f"{self.prefix}:log", 0, -1)]

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        logs = "\n".join(w.log()[-3000:] for w in self.workers)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")

    def prio_cli(self, *args: str) -> str:
        """Run ``celery -A tests.workerapp prio ...`` against this test's broker; its stdout."""
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp", "prio", *args],
            env={**os.environ, **self.worker_env()},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def depth(self, tier: Tier) -> int:
        """Messages waiting in the tier: its queue and sub-queues (realtime's shortest-first ones)."""
        return self.adapter.tier_depth(load_settings(self.app.conf), tier)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        try:
            names = [self.queue(t) for t in TIERS]
            names += [f"{n}.promoted" for n in names] + [f"{n}.dlx" for n in names] + [f"{self.prefix}.dead"]
            self.adapter.delete_queues(names)
            if self.kind == "redis":
                # Everything else under the prefix: stats, sub-queues and their registry, slice markers.
                for key in self.adapter.client.scan_iter(f"{self.prefix}.*"):
                    self.adapter.client.delete(key)
            else:
                # Found through the broker itself (the registry stream), management API or not; what is
                # left (slice markers) goes in the session's last sweep (``_sweep_rabbitmq_test_queues``).
                self.adapter.delete_queues(self.adapter.app_queues(load_settings(self.app.conf)))
        finally:
            self.adapter.close()


TEST_QUEUE = re.compile(r"^(t|bench)[0-9a-f]{8,10}[.-]")  # "-default", "-celery": the adoption tests' own


@pytest.fixture(scope="session", autouse=True)
def _sweep_rabbitmq_test_queues():
    """At the end of the run, delete every queue a test prefix left on the machine's RabbitMQ (slice markers,
    queues of killed runs), listed with ``rabbitmqctl`` so that no management plugin is needed."""
    yield
    if not _reachable(AMQP_URL):
        return
    try:
        listed = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "name", "--no-table-headers"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return
    from kombu import Connection

    with Connection(AMQP_URL) as conn:
        channel = conn.channel()
        for name in (n for n in listed if TEST_QUEUE.match(n)):
            channel.queue_delete(queue=name)


@pytest.fixture(params=["redis", "amqp"])
def env(request, tmp_path):
    yield from _one_broker_env(request.param, tmp_path)


def _one_broker_env(kind: str, tmp_path: Path, **base_settings: Any):
    need_broker(kind)
    e = PrioEnv(kind, tmp_path, base_settings=base_settings)
    yield e
    e.close()


@pytest.fixture
def redis_env(tmp_path):
    yield from _one_broker_env("redis", tmp_path)


@pytest.fixture
def amqp_env(tmp_path):
    yield from _one_broker_env("amqp", tmp_path)


def closed_management_url() -> str:
    """A management API URL where nothing listens: RabbitMQ as the stock image runs it (no plugin)."""
    from celery_prio.tools.workers import free_port

    return f"http://guest:guest@127.0.0.1:{free_port()}"


@pytest.fixture(params=["redis", "amqp", "amqp_no_management"])
def stock_env(request, tmp_path):
    """Redis, RabbitMQ as this machine runs it, and RabbitMQ with ``prio_management_url`` at a closed port."""
    if request.param == "amqp_no_management":
        yield from _one_broker_env("amqp", tmp_path, management_url=closed_management_url())
    else:
        yield from _one_broker_env(request.param, tmp_path)


@pytest.fixture
def amqp_push_env(tmp_path):
    """RabbitMQ with ``prio_fetch="consume"``: tier queues pushed to the worker."""
    yield from _one_broker_env("amqp", tmp_path, fetch="consume")


__all__ = ["PrioEnv", "load_settings", "need_broker"]


@pytest.fixture
def redis_parts(redis_env):
    """Real Redis in this process: ``(env, settings, adapter, fetch source)`` (aging on, so stamps are read)."""
    from celery_prio import settings_for
    from celery_prio.brokers.redis.admin import RedisAdapter
    from celery_prio.brokers.redis.fetch import RedisFetchSource
    from celery_prio.policy.served import ServedQueues
    from celery_prio.tiers import TIERS

    env = redis_env
    env.configure(aging={"batch": 60, "offline": 60})
    app = env.app
    conn = app.connection_for_write()
    channel = conn.default_channel
    s = settings_for(app)
    served = ServedQueues(s, [s.queue_name(t) for t in TIERS])
    parts = (env, s, RedisAdapter(app, client=channel.client), RedisFetchSource(app, channel, served, s, "fuzz"))
    yield parts
    conn.release()
