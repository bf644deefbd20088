"""Boost's trust on RabbitMQ (issue 34, item 7): every message that changes what runs is signed.

Pure: the key is derived from a canonical form of the broker's credentials
(the same however a process spells the URL), and not at all where it would be
guessable. Real RabbitMQ and workers: a forged ``prio_supersede`` is not
obeyed; with the guest URL and no ``prio_boost_key`` a boost is refused with a
reason that names the setting; with a real password, processes spelling the
URL differently boost each other's tasks without any key configured.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

import celery_prio
from celery_prio.signing import NO_KEY, boost_key, sign, verified
from celery_prio.tiers import Tier
from tests.conftest import PrioEnv, need_broker
from tests.test_boost import backlog, runs, start_worker
from tests.workerapp import make_app


# -- pure --------------------------------------------------------------------------------------------------------
def test_the_derived_key_is_the_same_however_the_url_is_spelled():
    key = boost_key("amqp://user:s3cret-pass@localhost:5672//", "app", None)
    assert key is not None
    assert boost_key("pyamqp://user:s3cret-pass@127.0.0.1/", "app", None) == key
    assert boost_key("amqp://user:s3cret-pass@rabbit-0;amqp://user:s3cret-pass@rabbit-1", "app", None) == key
    assert boost_key("amqp://user:s3cret-pass@localhost/other-vhost", "app", None) != key  # another vhost
    assert boost_key("amqp://user:other-pass@localhost//", "app", None) != key  # another secret
    assert boost_key("amqp://user:s3cret-pass@localhost//", "other-prefix", None) != key


@pytest.mark.parametrize("url", ["amqp://guest:guest@localhost//", "amqp://localhost//", "amqp://user@host//", ""])
def test_no_key_is_derived_where_it_would_be_guessable(url):
    assert boost_key(url, "app", None) is None
    assert boost_key(url, "app", "an-explicit-key-of-16+") == b"an-explicit-key-of-16+"


def test_signatures_bind_every_part():
    key = b"k" * 16
    sig = sign(key, "supersede", "id-1", 2, "commit")
    assert verified(key, sig, "supersede", "id-1", 2, "commit")
    assert not verified(key, sig, "supersede", "id-1", 2, "retract")
    assert not verified(key, sig, "supersede", "id-2", 2, "commit")
    assert not verified(b"x" * 16, sig, "supersede", "id-1", 2, "commit")
    assert not verified(None, sig, "supersede", "id-1", 2, "commit") and not verified(key, None, "x")


# -- real RabbitMQ and workers ----------------------------------------------------------------------------------
@pytest.fixture
def amqp_keyed_env(tmp_path):
    need_broker("amqp")
    e = PrioEnv("amqp", tmp_path)
    yield e
    e.close()


def test_a_forged_supersede_broadcast_is_not_obeyed(amqp_keyed_env):
    """Anyone on the vhost can broadcast; an unsigned "commit" would make every worker ack a task unrun."""
    env = amqp_keyed_env
    worker = start_worker(env, concurrency=2)
    task_id = f"forged-{uuid.uuid4().hex[:8]}"
    env.app.control.broadcast("prio_supersede", arguments={"task_id": task_id, "generation": 1, "commit": True})
    forged_sig = sign(b"not-the-app-key!", "supersede", task_id, 1, "commit")
    env.app.control.broadcast(
        "prio_supersede", arguments={"task_id": task_id, "generation": 1, "commit": True, "sig": forged_sig}
    )
    time.sleep(0.5)  # both reached the worker before the task does
    result = env.app.tasks["t.sleep"].apply_async(("victim", 0.0), tier="offline", task_id=task_id)
    assert result.get(timeout=20) == "victim"
    assert runs(env, "victim") == 1
    env.wait_for(lambda: "ignored a prio_supersede broadcast" in worker.log(), what="the worker to say so")


def test_with_the_guest_url_and_no_key_a_boost_is_refused_naming_the_setting(tmp_path):
    need_broker("amqp")
    env = PrioEnv("amqp", tmp_path, base_settings={"boost_key": None})
    try:
        worker = start_worker(env, concurrency=2)
        assert NO_KEY in worker.log()  # the worker says at start why boosts are off
        backlog(env, 2, 2.0)
        queued = env.app.tasks["t.sleep"].apply_async(("queued", 0.0), tier="offline")
        outcome = celery_prio.boost(queued, "realtime")
        assert outcome.outcome == "refused" and "prio_boost_key" in outcome.detail
        assert queued.get(timeout=30) == "queued" and runs(env, "queued") == 1  # it still runs, in its turn
    finally:
        env.close()


@pytest.fixture
def rabbit_user():
    """A RabbitMQ user with a real password on the default vhost (removed after the test)."""
    need_broker("amqp")
    name, password = f"prio-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex

    def ctl(*args: str) -> None:
        subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)

    try:
        ctl("add_user", name, password)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot add a RabbitMQ user here: {exc}")
    try:
        ctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
        yield name, password
    finally:
        ctl("delete_user", name)


def test_processes_spelling_the_url_differently_boost_without_a_configured_key(tmp_path, rabbit_user):
    user, password = rabbit_user
    worker_url = f"amqp://{user}:{password}@127.0.0.1:5672//"
    env = PrioEnv("amqp", tmp_path, broker=worker_url, base_settings={"boost_key": None})
    # The publishing process spells the same broker another way: scheme, host name, no port, no vhost.
    env.app = make_app(env.prefix, f"pyamqp://{user}:{password}@localhost/", env.backend, env.settings)
    try:
        start_worker(env, concurrency=2)  # with reserve 1: offline's only slot
        backlog(env, 2, 4.0)
        env.wait_for(lambda: runs(env, "b0") == 1, what="the backlog to hold the slot")
        queued = env.app.tasks["t.sleep"].apply_async(("queued", 0.0), tier="offline")
        outcome = celery_prio.boost(queued, "realtime")
        assert outcome.outcome == "boosted" and outcome.tier is Tier.REALTIME, outcome
        assert queued.get(timeout=3) == "queued"
        env.wait_for(lambda: runs(env, "b1") == 1, timeout=30, what="the backlog to finish")
        time.sleep(0.5)
        assert runs(env, "queued") == 1  # the original was skipped when its turn came: one run
    finally:
        env.close()
