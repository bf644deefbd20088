"""``basic.publish`` frames for a bulk chunk, encoded here and written in one go (AMQP 0-9-1).

py-amqp encodes and writes every publish on its own: a method frame, a
header frame whose property table it encodes field by field in pure Python,
a body frame, one socket write. For a chunk of a bulk publish almost all of
that is the same from message to message: one exchange and routing key, one
set of properties, ~20 Celery headers that only differ in a handful of
fields. ``PublishFrames`` encodes the common parts once per session and, per
message, only its body, its ``correlation_id`` and the headers that differ,
into one buffer the caller writes to the socket once per chunk. The bytes
are the ones py-amqp would send (``tests/test_bulk.py`` compares them with
the output of py-amqp's own frame writer).
"""

from __future__ import annotations

from struct import pack
from typing import Any

import amqp
from amqp.serialization import dumps

BASIC_CLASS, PUBLISH_METHOD = 60, 40
METHOD_FRAME, HEADER_FRAME, BODY_FRAME = 1, 2, 3
FRAME_END = b"\xce"


def shortstr(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    if len(data) > 255:
        raise ValueError(f"AMQP short string longer than 255 bytes: {value[:40]!r}...")
    return bytes((len(data),)) + data


def table_item(key: str, value: Any) -> bytes:
    """One field-table entry, as py-amqp's ``_write_item`` encodes it (strings and floats by hand)."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return shortstr(key) + b"S" + pack(">I", len(data)) + data
    if isinstance(value, float):
        return shortstr(key) + b"d" + pack(">d", value)
    return dumps(b"F", [{key: value}])[4:]  # ints, None, nested: py-amqp's own encoding


class PublishFrames:
    """The frames of one ``basic.publish`` per message, for one channel, exchange and routing key.

    ``properties`` are the message properties shared by every message
    (without ``application_headers`` and ``correlation_id``); ``shared``
    the headers every message carries unchanged.
    """

    def __init__(
        self,
        channel_id: int,
        frame_max: int,
        exchange: str,
        routing_key: str,
        properties: dict[str, Any],
        shared: dict[str, Any],
    ) -> None:
        self.channel_id = channel_id
        self.body_max = frame_max - 8  # a frame's type, channel, size and end byte
        method = pack(">HHH", BASIC_CLASS, PUBLISH_METHOD, 0) + shortstr(exchange) + shortstr(routing_key) + b"\0"
        self.method_frame = pack(">BHI", METHOD_FRAME, channel_id, len(method)) + method + FRAME_END
        self.shared_items = dumps(b"F", [shared])[4:]
        # Properties in AMQP's order, in three runs around the two that differ per message.
        runs: list[tuple[list[bytes], list[Any]]] = [([], []), ([], []), ([], [])]
        flags, shift, run = 0, 15, 0
        for key, proptype in amqp.Message.PROPERTIES:
            if key == "application_headers":
                flags |= 1 << shift
                run = 1
            elif key == "correlation_id":
                flags |= 1 << shift
                run = 2
            elif properties.get(key) is not None:
                flags |= 1 << shift
                runs[run][0].append(proptype.encode())
                runs[run][1].append(properties[key])
            shift -= 1
        before, middle, after = (dumps(b"".join(f), v) if f else b"" for f, v in runs)
        self.props_head = pack(">H", flags) + before
        self.props_middle = middle
        self.props_tail = after

    def add(self, out: bytearray, body: bytes, correlation_id: str, variable: dict[str, Any]) -> None:
        """Append one message's frames to ``out``."""
        items = self.shared_items + b"".join([table_item(k, v) for k, v in variable.items()])
        header = b"".join(
            (
                pack(">HHQ", BASIC_CLASS, 0, len(body)),
                self.props_head,
                pack(">I", len(items)),
                items,
                self.props_middle,
                shortstr(correlation_id),
                self.props_tail,
            )
        )
        channel = self.channel_id
        out += self.method_frame
        out += pack(">BHI", HEADER_FRAME, channel, len(header))
        out += header
        out += FRAME_END
        for start in range(0, len(body), self.body_max):  # an empty body has no body frame
            part = body[start : start + self.body_max]
            out += pack(">BHI", BODY_FRAME, channel, len(part))
            out += part
            out += FRAME_END
