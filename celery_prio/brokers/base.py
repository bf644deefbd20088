"""What every broker adapter offers."""

from __future__ import annotations

from typing import Any


class BrokerAdapter:
    kind = "?"

    def __init__(self, app: Any) -> None:
        self.app = app

    def depth(self, queue: str) -> int:
        """Messages waiting in ``queue`` (not counting those held unacked by workers)."""
        raise NotImplementedError

    def delete_queues(self, queues: list[str]) -> None:
        """Remove queues and everything in them (tests and ``prio purge``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections."""
