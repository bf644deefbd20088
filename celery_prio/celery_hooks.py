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
* **A batched task made before the app is finalized** (``Celery._task_from_fun``):
  its caller passes one call's arguments, the function takes a list of
  calls. ``install()`` made the task take both at finalize; a publisher
  that calls the task before its app is finalized (a web app importing the
  tasks module and calling at once) got Celery's argument check against the
  list-taking function (``TypeError: classify() takes 1 positional argument
  but 2 were given``), and eager mode passed the function one call's
  arguments. Here a task declared with ``batch=`` takes both from the moment
  it is made. Celery's ``task_annotations`` would not do: only the first
  annotation that matches a task applies, so ours would hide the app's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.result import AsyncResult, ResultSet

from .batching import batch_of, takes_batches
from .errors import ConfigError
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


def batched_from_the_start() -> None:
    """Once per process: a task declared with ``batch=`` takes a single call too, from the moment it is made."""
    original = Celery._task_from_fun
    if getattr(original, "celery_prio", False):
        return

    @functools.wraps(original)
    def task_from_fun(self: Any, fun: Any, *args: Any, **options: Any) -> Any:
        task = original(self, fun, *args, **options)
        try:
            if batch_of(task) is not None:
                takes_batches(task)
        except ConfigError:  # a bad batch=: the worker refuses to start, naming the task (install._on_finalize)
            pass
        return task

    task_from_fun.celery_prio = True  # type: ignore[attr-defined]
    Celery._task_from_fun = task_from_fun  # type: ignore[method-assign]


def count_result_waits() -> None:
    """Once per process: a task blocked on results counts as waiting, not as running (see the module doc)."""
    for cls, name in RESULT_WAITS:
        method = cls.__dict__.get(name)
        if method is not None and not getattr(method, "celery_prio", False):
            setattr(cls, name, _counted_as_waiting(method))


__all__ = ["RESULT_WAITS", "batched_from_the_start", "count_result_waits"]
