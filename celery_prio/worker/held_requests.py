"""The requests a worker process holds, read from Celery's own bookkeeping across the versions supported.

Celery 5.7 keeps ETA/countdown requests in ``worker.state.scheduled_requests``;
5.5 and 5.6 have no such set (such a request is only an entry on the worker's
timer until it is due), so there they are read from the timer's entries.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from celery.worker import state as worker_state
from celery.worker.request import Request

if TYPE_CHECKING:
    from kombu.asynchronous.timer import Timer


def scheduled_requests(timer: Timer | None) -> list[Request]:
    """ETA/countdown requests waiting to be due (``timer``: the worker's timer, for Celery < 5.7)."""
    scheduled = getattr(worker_state, "scheduled_requests", None)
    if scheduled is not None:
        return list(scheduled)
    # The timer's queue holds (eta, priority, entry); Celery < 5.7 enters an ETA request
    # as apply_eta_task(req) or _limit_post_eta(req, bucket, tokens).
    entries = [item.entry for item in timer.queue] if timer is not None else []
    return [entry.args[0] for entry in entries if entry.args and isinstance(entry.args[0], Request)]


def waiting_requests(timer: Timer | None) -> list[Request]:
    """Requests accepted but not started: reserved ones and scheduled (ETA) ones."""
    return [*worker_state.reserved_requests, *scheduled_requests(timer)]


def held_requests(timer: Timer | None) -> list[Request]:
    """Every request this process runs or will run: active, reserved and scheduled."""
    return [*worker_state.active_requests, *waiting_requests(timer)]


def delivery_tags(requests: Iterable[Request]) -> set[str]:
    return {str(tag) for r in requests if (tag := getattr(getattr(r, "message", None), "delivery_tag", None))}
