"""The example app without celery-prio (the demo's plain-Celery baseline)."""

from __future__ import annotations

from typing import Any

from celery_prio.batching import batch_of
from celery_prio.celery_hooks import takes_batches


def batches_of_one(sender: Any, **_: Any) -> None:
    """``on_after_finalize``: each batched task takes a single call as a batch of one (nothing batches them)."""
    for task in sender.tasks.values():
        if batch_of(task) is not None:
            takes_batches(task)
