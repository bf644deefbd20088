"""Checks for what a broker hands us: anyone can push anything onto a tier queue.

Pure functions, no broker and no Celery. Every function here answers for any
input (lists, strings, NaN, nested garbage) without raising, so the fetch
loop, aging, stats and the dead-letter tools can call them on raw data.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from .headers import ENQUEUED_HEADER


def valid_stamp(value: object) -> float | None:
    """An enqueue stamp as a float, or None when it is not a finite number (``true`` is not a number)."""
    if type(value) is float:  # (what every publish stamps: one check, asked per task a worker runs)
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def enqueue_age(headers: object, now: float) -> float | None:
    """Seconds since a message was first enqueued (None: no usable stamp). A future stamp counts as now."""
    if type(headers) is not dict and not isinstance(headers, Mapping):  # (a dict first: the ABC check is slower)
        return None
    stamp = valid_stamp(headers.get(ENQUEUED_HEADER))
    return None if stamp is None else max(0.0, now - stamp)


def headers_problem(headers: object) -> str | None:
    """Why message headers cannot be handed to Celery, or None when they can.

    Celery's task handler indexes the headers (``headers['task']``); a list or
    a string there raises out of the handler. A missing ``task`` is fine
    (protocol 1 keeps it in the body; Celery handles that itself).
    """
    if headers is None:
        return None
    if type(headers) is not dict and not isinstance(headers, Mapping):  # (a dict first: the ABC check is slower)
        return f"malformed: headers are a {type(headers).__name__}, not a mapping"
    for key in ("task", "id"):
        if key in headers and not isinstance(headers[key], str):
            return f"malformed: header {key!r} is a {type(headers[key]).__name__}, not a string"
    return None


def redis_envelope_problem(payload: object) -> str | None:
    """Why a decoded Redis list element is not a kombu message envelope, or None.

    Mirrors what ``kombu.transport.virtual.Message`` needs, so that building
    the message cannot raise. (The fetch script checks the same first.)
    """
    # Same checks, same words as the fetch script (brokers/redis/lua/fetch.lua).
    if not isinstance(payload, Mapping):
        return "malformed: envelope is not an object"
    props = payload.get("properties")
    if not isinstance(props, Mapping):
        return "malformed: envelope has no 'properties' object"
    if not isinstance(props.get("delivery_tag"), str):
        return "malformed: properties.delivery_tag missing or not a string"
    if "headers" in payload and not isinstance(payload["headers"], Mapping):
        return "malformed: headers are not an object"
    for key in ("body", "content-type", "content-encoding"):
        if payload.get(key) is not None and not isinstance(payload[key], str):
            return f"malformed: {key!r} is not a string"
    if props.get("body_encoding") is not None and not isinstance(props["body_encoding"], str):
        return "malformed: properties.body_encoding is not a string"
    if props.get("delivery_info") is not None and not isinstance(props["delivery_info"], Mapping):
        return "malformed: properties.delivery_info is not an object"
    return headers_problem(payload.get("headers"))


def decode_problem(exc: BaseException) -> str:
    """The dead-letter reason for what Python's JSON decoder raised on an element Redis' cjson accepted."""
    if isinstance(exc, RecursionError):
        return "malformed: too deeply nested for Python's JSON decoder (RecursionError)"
    if isinstance(exc, MemoryError):
        return "malformed: too large to decode (MemoryError)"
    return f"malformed: not JSON ({exc.__class__.__name__})"


def decode_redis_element(raw: bytes | str) -> tuple[dict[str, object] | None, str | None]:
    """``(envelope, None)`` for a usable element, ``(None, reason)`` otherwise."""
    try:
        payload = json.loads(raw)
    except Exception as exc:  # RecursionError and MemoryError too: anything the decoder raises
        return None, decode_problem(exc)
    problem = redis_envelope_problem(payload)
    return (None, problem) if problem else (payload, None)


def death_records(headers: object) -> list[Mapping[str, object]]:
    """RabbitMQ's ``x-death`` list, keeping only well-formed records (a number or string there is ignored)."""
    deaths = headers.get("x-death") if isinstance(headers, Mapping) else None
    if deaths is None:  # (most messages: nothing dead-lettered them)
        return []
    if not isinstance(deaths, (list, tuple)):
        return []
    return [d for d in deaths if isinstance(d, Mapping)]


def was_promoted_by_broker(headers: object) -> bool:
    """RabbitMQ aging: the message expired out of a lower tier into this one."""
    return any(d.get("reason") == "expired" for d in death_records(headers))


#: The end of an unacked entry as the fetch script (``[raw,"",queue]``) or kombu (``[raw, "", queue]``) writes it.
_ENTRY_TAIL = re.compile(rb',\s*"(?:[^"\\]|\\.)*",\s*"((?:[^"\\]|\\.)*)"\]\s*$')


def split_unacked_entry(entry: bytes) -> tuple[bytes, str]:
    """``(raw message, queue)`` of a kombu unacked entry, without decoding the message (it may not decode)."""
    match = _ENTRY_TAIL.search(entry)
    if not entry.startswith(b"[") or match is None:
        return entry, ""
    return entry[1 : match.start()], match.group(1).decode(errors="replace")
