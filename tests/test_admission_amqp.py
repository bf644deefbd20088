"""RabbitMQ's admission by predicted wait under faults: the housekeeper SIGKILLed, a record that is not one, the
publisher's readings cut off. Real RabbitMQ, real workers."""

from __future__ import annotations

import json
import logging
import time

import amqp
import pytest
from test_admission import _surge, _warm, fleet_figures

from celery_prio import QueueFull
from celery_prio.runtime import publisher_of

pytestmark = pytest.mark.broker

SHARE = 8 / 11  # realtime's weight of a worker serving every tier


def _slots_become(env, slots: float, what: str) -> None:
    env.wait_for(lambda: abs(fleet_figures(env)[0] - slots) < 0.01, timeout=20, what=what)


def test_a_killed_housekeeper_is_replaced_and_its_slots_leave_the_record(amqp_env):
    env = amqp_env
    env.configure(max_wait={"realtime": 0.5}, realtime_deadline=0)
    first = env.start_worker(concurrency=1)  # first: it takes the lease
    _slots_become(env, 1 * SHARE, "the first worker's slots")
    env.start_worker(concurrency=3)
    _slots_become(env, 4 * SHARE, "both workers' slots")
    first.kill()  # SIGKILL: RabbitMQ closes its connection, and with it the lease queue
    _slots_become(env, 3 * SHARE, "the other worker keeps the record, without the dead one's slots")
    _warm(env, 0.3)
    accepted, refused = _surge(env, 30, 0.3)
    assert refused and accepted, "admission goes on with the new housekeeper"
    for result in accepted:
        result.get(timeout=30)


def test_a_record_that_is_not_one_admits_by_the_cap_and_is_replaced(amqp_env):
    env = amqp_env
    env.configure(max_wait={"realtime": 0.2}, max_length={"realtime": 25}, realtime_deadline=0)
    with env.app.connection_for_write() as conn:
        channel = conn.channel()
        from celery_prio import settings_for
        from celery_prio.brokers.amqp.fleet_figures import declare_record_queue

        declare_record_queue(channel, settings_for(env.app))
        for body in (b"not json", json.dumps({"slots": {"realtime": "many"}}).encode()):
            channel.basic_publish(amqp.Message(body), exchange="", routing_key=f"{env.prefix}.admission")
        channel.close()
    accepted, refused = _surge(env, 30, 0.1)  # no record to go by: the cap alone
    assert len(accepted) == 25 and [f.reason for f in refused] == ["cap"] * 5
    env.start_worker(concurrency=2)
    for result in accepted:  # nothing accepted is lost
        result.get(timeout=30)
    _warm(env, 0.1)  # the housekeeper's record replaced it


def test_readings_that_fail_admit_by_the_cap_and_come_back(amqp_env, caplog):
    env = amqp_env
    env.configure(max_wait={"realtime": 0.3}, realtime_deadline=0)
    env.start_worker(concurrency=1)
    _warm(env, 0.2)
    _, refused = _surge(env, 20, 0.2)
    assert refused
    with env.app.connection_for_write() as conn:  # an operator deletes the record's queue: an error reply
        channel = conn.channel()
        channel.queue_delete(f"{env.prefix}.admission")
        channel.close()
    time.sleep(0.6)  # past RECORD_FRESH: the next call reads again
    with caplog.at_level(logging.WARNING, logger="celery_prio.brokers.amqp.admission"):
        result = env.app.tasks["t.rt_sleep"].delay("through", 0.2)  # admitted: a failed reading never fails it
    assert "admission readings failed" in caplog.text
    assert publisher_of(env.app).admission._connection is None  # let go; made again after RETRY_AFTER_FAILURE
    with pytest.raises(QueueFull) as refused_again:
        for i in range(300):  # the queue declared again, the housekeeper's next record in it: refused again
            env.app.tasks["t.rt_sleep"].delay(f"again{i}", 0.2)
            time.sleep(0.01)
    assert refused_again.value.reason == "wait"
    result.get(timeout=120)
