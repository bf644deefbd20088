"""RabbitMQ connections closed under load (issue 26): the worker reconnects and runs on, every accepted
task completes. Real RabbitMQ (the worker's connections closed with ``rabbitmqctl``), a real worker.

The worker connects as a user of its own, so that only its connections are closed (closing every
connection would also close the test process's shared kombu pools)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.test_incarnation import ended

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def rabbitmqctl(*args: str) -> str:
    done = subprocess.run(["rabbitmqctl", "-q", *args], check=True, timeout=60, capture_output=True, text=True)
    return done.stdout


def close_connections_of(user: str) -> int:
    closed = 0
    for line in rabbitmqctl("list_connections", "pid", "user", "--no-table-headers").splitlines():
        pid, _, who = line.strip().partition("\t")
        if who.strip() == user:
            rabbitmqctl("close_connection", pid, "celery-prio test: connection closed")
            closed += 1
    return closed


def test_rabbitmq_connections_closed_mid_load_kill_no_worker_and_lose_nothing(amqp_env):
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("no rabbitmqctl to close the broker's connections")
    env = amqp_env
    user, password = f"reconnect-{env.prefix}", "reconnect-pw"
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        broker = f"amqp://{user}:{password}@127.0.0.1:5672//"
        worker = env.start_worker(concurrency=4, env_extra={"PRIO_TEST_BROKER": broker})
        n = 200
        task = env.app.tasks["t.batch_late"]
        for i in range(n):
            task.apply_async((f"load-{i}", 0.02))
        env.wait_for(lambda: len(ended(env)) >= 40, timeout=30, what="the load to be under way")
        assert close_connections_of(user) >= 1
        env.wait_for(lambda: len(ended(env)) >= 100, timeout=60, what="the load to go on after the reconnect")
        assert close_connections_of(user) >= 1  # again, on the connections the reconnect opened
        env.wait_for(lambda: len(ended(env)) == n, timeout=90, what=f"all {n} tasks to complete")
        assert worker.proc.poll() is None, "the worker died when its connections were closed"
        log = worker.log()
        assert "Unrecoverable error" not in log and "Connection to broker lost" in log
    finally:
        rabbitmqctl("delete_user", user)
