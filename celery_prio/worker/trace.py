"""An opt-in, bounded trace of what a worker ran, for ``prio simulate --trace``.

With ``prio_trace_file`` set, a worker's main process appends one JSON line
per finished task — tier, queue, task name, enqueue, start and end time
(epoch seconds) — and stops after ``prio_trace_max`` lines, so a forgotten
setting cannot fill a disk. Several workers may share one file on one host
(each line is one ``write`` in append mode); across hosts, collect theirs.
Nothing of the task's arguments or result is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from ..headers import ENQUEUED_HEADER
from ..untrusted import valid_stamp

logger = logging.getLogger(__name__)


class TraceRecorder:
    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self.written = 0
        self._fd: int | None = None

    def record(self, settled: Any) -> None:
        """Called once per finished run (``ledger.Settled``, its key a Celery request)."""
        if self.written >= self.limit:
            return
        request = settled.key
        end = time.time()
        headers = getattr(request, "request_dict", None) or {}
        row = {
            "tier": settled.tier.label,
            "queue": settled.queue,
            "task": getattr(request, "name", None),
            "enqueued_at": valid_stamp(headers.get(ENQUEUED_HEADER)),
            "start": end - settled.runtime,
            "end": end,
        }
        if row["enqueued_at"] is None:
            row["enqueued_at"] = row["start"]  # unstamped: it waited no time we know of
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, (json.dumps(row) + "\n").encode())
        except OSError as exc:
            logger.warning("celery-prio: cannot write the trace to %s (%s): tracing off", self.path, exc)
            self.written = self.limit
            return
        self.written += 1
        if self.written == self.limit:
            logger.info("celery-prio: trace of %d tasks written to %s (prio_trace_max)", self.limit, self.path)
