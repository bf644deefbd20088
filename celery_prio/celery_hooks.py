"""Where celery-prio changes what Celery itself does, with why no public hook serves.

Checked against Celery 5.5, 5.6 and 5.7 (``tests/test_celery_hooks.py`` runs
each patch on the installed version). Each patch is applied once per process
by ``install()`` and is idempotent.

* **A task blocked on other tasks' results** (``AsyncResult.get``/``wait``,
  ``ResultSet.join``/``join_native``, hence ``GroupResult.get``): inside a
  worker task its slot is counted as *waiting* while it blocks, so the
  worker may start the work it waits on in another slot. Celery has no
  signal around a blocking wait; without this a task that waits on its own
  group (``.get(disable_sync_subtasks=False)``, a documented pattern) holds
  its tier's only slot while its children queue behind it: a deadlock that
  plain Celery does not have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery.result import AsyncResult, ResultSet

from .producer.inherit import running_task_tier
from .worker.slice_board import blocked_waiting

#: ``(class, method)`` pairs whose calls block on results.
RESULT_WAITS: tuple[tuple[type, str], ...] = (
    (AsyncResult, "get"),
    (AsyncResult, "wait"),
    (ResultSet, "join"),
    (ResultSet, "join_native"),
)


def _counted_as_waiting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def blocking_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with blocked_waiting(running_task_tier(self.app)):
            return method(self, *args, **kwargs)

    blocking_wait.celery_prio = True  # type: ignore[attr-defined]
    return blocking_wait


def count_result_waits() -> None:
    """Once per process: a task blocked on results counts as waiting, not as running (see the module doc)."""
    for cls, name in RESULT_WAITS:
        method = cls.__dict__.get(name)
        if method is not None and not getattr(method, "celery_prio", False):
            setattr(cls, name, _counted_as_waiting(method))


__all__ = ["RESULT_WAITS", "count_result_waits"]
