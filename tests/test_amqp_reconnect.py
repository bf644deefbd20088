"""RabbitMQ connections closed under load (issue 26): the worker reconnects and runs on, every accepted
task completes. Real RabbitMQ (its connections closed with ``rabbitmqctl``), a real worker."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from celery_prio.brokers import adapter_for
from tests.test_incarnation import ended

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_rabbitmq_connections_closed_mid_load_kill_no_worker_and_lose_nothing(amqp_env):
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("no rabbitmqctl to close the broker's connections")
    env = amqp_env
    worker = env.start_worker(concurrency=4)
    n = 200
    task = env.app.tasks["t.batch_late"]
    for i in range(n):
        task.apply_async((f"load-{i}", 0.02))
    env.wait_for(lambda: len(ended(env)) >= 40, timeout=30, what="the load to be under way")
    for _ in range(2):  # twice: the second lands on the connections the first made the worker open
        subprocess.run(
            ["rabbitmqctl", "-q", "close_all_connections", "celery-prio test: connections closed"],
            check=True,
            timeout=60,
            capture_output=True,
        )
    env.adapter = adapter_for(env.app)  # this process's connections were closed too: a fresh one for cleanup
    env.app.pool.force_close_all()
    env.wait_for(lambda: len(ended(env)) == n, timeout=90, what=f"all {n} tasks to complete")
    assert worker.proc.poll() is None, "the worker died when its connections were closed"
    log = worker.log()
    assert "Unrecoverable error" not in log and "Connection to broker lost" in log
