"""RabbitMQ's sub-queue registry takes only this app's sub-queue names: its records are data (real broker)."""

from __future__ import annotations

import amqp
import pytest

from celery_prio import settings_for
from celery_prio.brokers.amqp.registry import announce, read_registry, registry_name

pytestmark = [pytest.mark.broker]


def test_forged_and_malformed_registry_records_are_ignored(amqp_env):
    env = amqp_env
    settings = settings_for(env.app)
    good = settings.subqueue_name(settings.default_tier, "acme")
    with env.app.connection_for_write() as conn:
        channel = conn.channel()
        announce(channel, settings, good)
        for headers in (
            {"subqueue": "other.batch.acme"},  # another app's prefix
            {"subqueue": f"{env.prefix}.batch.bad/name"},  # not a sub-queue name
            {"subqueue": f"{env.prefix}.batch.promoted"},  # a front lane, reserved
            {"subqueue": 5},
            {"nothing": "here"},
        ):
            channel.basic_publish_confirm(
                amqp.Message(b"", application_headers=headers), exchange="", routing_key=registry_name(settings)
            )
        channel.basic_publish_confirm(
            amqp.Message(b"not even headers"), exchange="", routing_key=registry_name(settings)
        )
        assert read_registry(conn.connection, settings) == [good]
