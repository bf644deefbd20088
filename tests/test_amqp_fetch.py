"""RabbitMQ's fetch source on a real broker: queues found empty are asked in the round trip of the next one."""

from __future__ import annotations

import time

import pytest

from celery_prio import settings_for
from celery_prio.brokers.amqp.fetch import PROBE_FRACTION, AmqpFetchSource
from celery_prio.policy.served import ServedQueues
from celery_prio.tiers import TIERS, Tier

pytestmark = pytest.mark.broker

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def test_empty_queues_ride_along_and_what_rode_behind_the_winner_goes_back(amqp_env):
    env = amqp_env
    env.configure(sjf=False)
    settings = settings_for(env.app)
    conn = env.app.connection_for_write()
    try:
        served = ServedQueues(settings, [settings.queue_name(t) for t in TIERS])
        source = AmqpFetchSource(env.app, conn.channel(), served, settings)
        windows: list[list[str]] = []
        real_get_many = source.get_many
        source.get_many = lambda queues: windows.append(list(queues)) or real_get_many(queues)  # count round trips

        order = [R, B, O]
        assert source.take(order).message is None  # every queue asked once, one by one: nothing known yet
        assert len(windows) == len([c for t in order for c in served.candidates(t)])
        sleep = env.app.tasks["t.sleep"]
        sleep.apply_async(("b", 0), tier="batch")
        sleep.apply_async(("r", 0), tier="realtime")
        time.sleep(settings.poll_interval * PROBE_FRACTION * 2)  # past the re-ask interval of empty queues

        windows.clear()
        take = source.take(order)
        assert take.tier is R and take.message.payload[0] == ["r", 0]
        assert len(windows) == 1  # one round trip: all were found empty before, so all rode together
        assert env.depth(B) == 1  # batch's message rode behind the winner: given back, not held
        take.message.ack()

        time.sleep(settings.poll_interval * PROBE_FRACTION * 2)
        windows.clear()
        take = source.take(order)
        assert take.tier is B and take.message.payload[0] == ["b", 0]
        assert take.empty == (R,)  # realtime's queues were all asked and empty on the way
        take.message.ack()
        assert env.depth(B) == 0 and env.depth(R) == 0
    finally:
        conn.release()
