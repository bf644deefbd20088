"""Redis bulk publish: a chunk is one script call, capped atomically."""

from __future__ import annotations

import time
from base64 import b64encode
from typing import TYPE_CHECKING, Any

from kombu.utils.json import dumps

from ...errors import QueueFull
from ..publishing import BulkSession
from ..shared import fast_json
from .scripts import BULK_PUSH
from .transport import drain_rate, wait_for_replicas

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection, Message

    from ...settings import PrioSettings
    from ...tiers import Tier


class RedisBulkSession(BulkSession):
    """A chunk is one script call: pushed under the cap atomically, the refused tail reported."""

    def __init__(
        self, app: Celery, connection: Connection, settings: PrioSettings, tier: Tier, queue: str | None = None
    ) -> None:
        super().__init__(app, connection, settings, tier, queue)
        self.client = self.channel.client
        self._push = self.client.register_script(BULK_PUSH)
        self.depth = 0
        self._shared_cache: dict[str, str] | None = None
        self._shared_kwargs: Any = None

    def publish(self, messages: list[Any]) -> list[bool]:
        payloads = [self._envelope(message) for message in messages]
        accepted, self.depth = self._push(
            keys=[
                self.queue,
                self.settings.dead_letter_queue,
                self.settings.stats_key,
                self.settings.bell_key(self.tier),
                self.settings.ready_key,
            ],
            args=[
                -1 if self.cap is None else self.cap,
                self.settings.overflow[self.tier],
                self.tier.label,
                time.time(),
                *payloads,
            ],
        )
        wait_for_replicas(self.client, self.channel.connection.client.transport_options)
        return [i < accepted for i in range(len(messages))]

    def _envelope(self, message: Message) -> str:
        """The JSON kombu's Redis channel writes for a publish (prepare_message + _inplace_augment_message).

        This is the hot loop of a bulk publish, so what every message of the
        chunk shares is encoded once (``_shared``) and only the per-message
        fields are encoded here.
        """
        if self.serializer != "json" or self.channel.body_encoding != "base64":
            return self._envelope_generic(message)
        args, kwargs, _ = message.body
        shared = self._shared(message)
        kwargs_json = shared["kwargs"] if kwargs is self._shared_kwargs else fast_json(kwargs)
        body = f"[{fast_json(args)}, {kwargs_json}, {shared['embed']}]".encode()
        headers = message.headers
        task_id = headers["id"]
        variable = {k: headers[k] for k in self.VARIABLE_HEADERS if k in headers}
        # Ids are "<uuid>-<n>": nothing in them needs escaping.
        return (
            f'{{"body": "{b64encode(body).decode()}", {shared["content"]}, '
            f'"headers": {{{shared["headers"]}, {fast_json(variable)[1:-1]}}}, '
            f'"properties": {{{shared["properties"]}, "correlation_id": "{task_id}", '
            f'"delivery_tag": "{task_id}.t"}}}}'
        )

    def _shared(self, message: Message) -> dict[str, str]:
        """What every message of this publish has in common (one template per session), encoded once."""
        if self._shared_cache is None:
            _, kwargs, embed = message.body
            headers = {k: v for k, v in message.headers.items() if k not in self.VARIABLE_HEADERS}
            properties = {k: v for k, v in message.properties.items() if k != "correlation_id"}
            properties.update(
                delivery_mode=2,
                delivery_info={"exchange": "", "routing_key": self.queue},  # as a single publish to the queue
                priority=self.channel.default_priority,
                body_encoding="base64",
            )
            self._shared_kwargs = kwargs  # bulk() shares one kwargs object; group calls each have their own
            self._shared_cache = {
                "kwargs": fast_json(kwargs),
                "embed": fast_json(embed),
                "content": '"content-encoding": "utf-8", "content-type": "application/json"',
                "headers": dumps(headers)[1:-1],
                "properties": dumps(properties)[1:-1],
            }
        return self._shared_cache

    def _envelope_generic(self, message: Message) -> str:
        prepared = self.prepare(message)
        self.channel._inplace_augment_message(prepared, "", self.queue)
        return dumps(prepared)

    def queue_full(self, accepted: int) -> QueueFull:
        rate = drain_rate(self.client, self.settings.stats_key, self.tier.label)
        return QueueFull.from_drain_rate(self.tier, int(self.depth), rate)
