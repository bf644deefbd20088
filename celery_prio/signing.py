"""The key boost messages are signed with on RabbitMQ, and the signatures.

Boost on RabbitMQ writes a journal and broadcasts ``prio_supersede`` (a
worker acks a superseded copy unrun): anything that can publish on the vhost
could otherwise make every worker skip a task. Journal records, the
broadcasts and the workers' answers carry an HMAC-SHA256 under one key:

* ``prio_boost_key`` when set (at least 16 characters): the same in every
  process of the app;
* else a key derived from the broker's credentials in a canonical form (user,
  password, virtual host; not the host, port or scheme, which processes spell
  differently: ``localhost`` and ``127.0.0.1``, ``amqp://`` and
  ``pyamqp://``, a default port written or not) and ``prio_queue_prefix``;
* none at all when that would be guessable: a URL without a password, or with
  RabbitMQ's well-known ``guest``. Boosts on RabbitMQ are then refused with a
  reason that names ``prio_boost_key``, and workers ignore ``prio_supersede``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kombu.utils.url import url_to_parts

if TYPE_CHECKING:
    from celery import Celery

    from .settings import PrioSettings

#: Passwords anyone can guess: no key is derived from them.
WELL_KNOWN_PASSWORDS = frozenset({"", "guest"})

#: Why there is no key, as the refusal and the worker's start-up line say it.
NO_KEY = (
    "boost on RabbitMQ needs prio_boost_key: the broker URL's password is empty or the well-known 'guest', so a key "
    "derived from it could be forged by anyone on the vhost"
)


def _credentials(url: str) -> tuple[str, str, str] | None:
    """``(user, password, vhost)`` of one broker URL in a canonical form, or None where the password is guessable."""
    parts = url_to_parts(url)
    password = parts.password or ""
    if password in WELL_KNOWN_PASSWORDS:
        return None
    vhost = (parts.path or "/").strip() or "/"  # kombu: no path is the default vhost "/"
    return parts.username or "guest", password, vhost


def boost_key(broker_url: str | Sequence[str] | None, queue_prefix: str, explicit: str | None) -> bytes | None:
    """The key for this app's boost messages (see the module doc); None where none can be had safely."""
    if explicit:
        return explicit.encode()
    urls = broker_url if isinstance(broker_url, (list, tuple)) else str(broker_url or "").split(";")
    canonical = sorted({c for c in (_credentials(u.strip()) for u in urls if u and u.strip()) if c is not None})
    if not canonical:
        return None
    material = json.dumps(["celery-prio boosts", canonical, queue_prefix])
    return hashlib.sha256(material.encode()).digest()


def app_boost_key(app: Celery, settings: PrioSettings) -> bytes | None:
    """``boost_key`` of an installed app: its write (else its) broker URL, its prefix, its ``prio_boost_key``."""
    url = app.conf.broker_write_url or app.conf.broker_url or ""
    return boost_key(url, settings.queue_prefix, settings.boost_key)


def sign(key: bytes, *parts: object) -> str:
    """The signature of ``parts`` (JSON-encodable values) under ``key``."""
    return hmac.new(key, json.dumps(list(parts)).encode(), hashlib.sha256).hexdigest()


def verified(key: bytes | None, signature: object, *parts: object) -> bool:
    """Whether ``signature`` is ``parts`` signed under ``key`` (never, without a key)."""
    return key is not None and isinstance(signature, str) and hmac.compare_digest(signature, sign(key, *parts))


__all__ = ["NO_KEY", "WELL_KNOWN_PASSWORDS", "app_boost_key", "boost_key", "sign", "verified"]
