"""Every place celery-prio changes what Celery itself does, with why no public hook serves.

Checked against Celery 5.5, 5.6 and 5.7: ``tests/test_celery_hooks.py`` runs
each patch on the installed Celery, and CI runs it on the newest Celery and
on the oldest the package allows (5.5). Each patch is applied by
``install()`` (the per-process ones once, idempotently) or by the worker's
consumer; the decisions stay in the modules named, this module only hooks
them in. Celery's private names are in ``celery_private.py``.

1. **A task blocked on other tasks' results** (``AsyncResult.get``/``wait``,
   ``ResultSet.join``/``join_native``, hence ``GroupResult.get``): inside a
   worker task its slot is counted as *waiting* while it blocks, so the
   worker may start the work it waits on in another slot. Celery has no
   signal around a blocking wait; without this a task that waits on its own
   group (``.get(disable_sync_subtasks=False)``, a documented pattern) holds
   its tier's only slot while its children queue behind it: a deadlock
   plain Celery does not have.
2. **A batched task made before the app is finalized**
   (``Celery._task_from_fun``): a task declared with ``batch=`` takes a single
   call as well as a list from the moment it is made. A publisher that calls
   the task before its app is finalized (a web app importing the tasks
   module and calling at once) would get Celery's argument check against
   the list-taking function. ``task_annotations`` would not do: only the
   first annotation that matches a task applies, so ours would hide the
   app's own.
3. **A batched task's ``run``** (:func:`takes_batches`): the function takes a
   list of calls; Celery calls ``run`` with one call's arguments (a direct
   call, eager mode, an ETA, and each call of a worker's batch under Celery's
   own tracer). Celery has no hook between the tracer and the function.
4. **Groups through the bulk path** (``group.apply_async``): an eligible group
   (``producer/canvas.py``) is published a chunk per round trip. Celery's
   ``before_task_publish`` signal sees one message at a time and cannot
   publish them together.
5. **Chains and chords lift their steps** (``_chain.apply_async``,
   ``chord.apply_async``): priority inheritance (``producer/inherit.py``)
   rewrites the steps' tiers once, as the canvas is published, so that the
   steps a worker publishes later carry them. No signal sees a canvas whole.
6. **Publishes admitted** (the app's ``send_task``, per app): the broker's
   ``before_send`` and a refusal turned into ``QueueFull`` naming the tier and
   queue the router chose (``producer/admission.py``). ``before_task_publish``
   cannot catch the broker's nack, which comes after it.
7. **A pool job leaving its slot** (the worker pool's ``apply_async``): the
   fetch loop refills the slot at once, inside the result callback where the
   prefork pool reads it on the worker's loop. Celery's ``task_postrun`` runs
   in the pool child, not in the worker's main process where the fetch runs.
8. **``celery inspect conf`` masks ``prio_management_url``** (Celery's
   ``HIDDEN_SETTINGS``): the URL may hold credentials; Celery offers no way
   to add a name to the list but to extend it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from celery import Celery, chord, group
from celery.result import AsyncResult, ResultSet
from kombu.exceptions import OperationalError

from .batching import Call, batch_of, keep_batch_run, results_of, settled_outcome
from .celery_private import ChainSignature
from .errors import ConfigError
from .producer.admission import before_send, refused
from .producer.canvas import bulk_call_of, publish_group
from .producer.inherit import lift_before_publish, running_task_tier
from .runtime import Prio
from .settings import PrioSettings
from .worker.slice_board import blocked_waiting

if TYPE_CHECKING:
    from celery import Signature, Task
    from celery.concurrency.base import BasePool
    from celery.result import GroupResult

#: Marks what celery-prio put in Celery's place (and what it replaced: ``__wrapped__``), so no patch is applied
#: twice.
MARK = "celery_prio"


def _ours(value: object) -> bool:
    return bool(getattr(value, MARK, False))


def _marked(wrapper: Callable[..., object], original: Callable[..., object]) -> Callable[..., object]:
    setattr(wrapper, MARK, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


# -- 1. result waits -----------------------------------------------------------------------------------------
#: ``(class, method)`` pairs whose calls block on results.
RESULT_WAITS: tuple[tuple[type, str], ...] = (
    (AsyncResult, "get"),
    (AsyncResult, "wait"),
    (ResultSet, "join"),
    (ResultSet, "join_native"),
)


def count_result_waits() -> None:
    """Once per process: a task blocked on results counts as waiting, not as running."""
    for cls, name in RESULT_WAITS:
        method = cls.__dict__.get(name)
        if method is None or _ours(method):
            continue

        def blocking_wait(
            self: AsyncResult | ResultSet, *args: object, _method: Callable[..., object] = method, **kwargs: object
        ) -> object:
            with blocked_waiting(running_task_tier(self.app)):
                return _method(self, *args, **kwargs)

        setattr(cls, name, _marked(functools.wraps(method)(blocking_wait), method))


# -- 2. and 3. batched tasks ---------------------------------------------------------------------------------
def batched_from_the_start() -> None:
    """Once per process: a task declared with ``batch=`` takes a single call too, from the moment it is made."""
    original = Celery._task_from_fun
    if _ours(original):
        return

    def task_from_fun(self: Celery, fun: Callable[..., object], *args: object, **options: object) -> Task:
        task = original(self, fun, *args, **options)
        try:
            if batch_of(task) is not None:
                takes_batches(task)
        except ConfigError:  # a bad batch=: the worker refuses to start, naming the task (install._on_finalize)
            pass
        return task

    Celery._task_from_fun = _marked(functools.wraps(original)(task_from_fun), original)  # type: ignore[method-assign]


def takes_batches(task: Task) -> None:
    """Make a batched task take a single call too (a direct call, eager mode, an ETA): as a batch of one.

    The function the user wrote, which takes a list of calls, is kept for the
    worker's batches (``batching.batch_run``). With Celery's ``autoretry_for``
    the wrapper sits inside Celery's retry wrapper, so an exception returned
    for one call of a batch retries that call. Idempotent.
    """
    # Celery's autoretry wrapper calls ``task._orig_run`` when it runs: wrap that, keep the retry outside.
    inner = "_orig_run" if getattr(task, "_orig_run", None) is not None else "run"
    run = getattr(task, inner)
    if not keep_batch_run(task, run):
        return

    def run_one(*args: object, **kwargs: object) -> object:
        settled = settled_outcome(getattr(task.request, "id", None))
        if settled is not None:  # a call of a worker's batch, under Celery's tracer: its outcome is known
            outcome, traceback = settled
            if isinstance(outcome, BaseException):
                raise outcome.with_traceback(traceback)
            return outcome
        if len(args) == 1 and not kwargs and isinstance(args[0], list) and all(isinstance(c, Call) for c in args[0]):
            return run(args[0])
        call = Call(getattr(task.request, "id", None) or "", tuple(args), dict(kwargs))
        (outcome,) = results_of(run, [call], task.name)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    setattr(run_one, MARK, True)
    setattr(task, inner, run_one)
    # Celery checks a call's arguments against the function's signature, which takes the list of calls:
    # a call's own arguments are the task's business (a bad one fails that call, in the batch).
    task.typing = False


# -- 4. and 5. canvas ----------------------------------------------------------------------------------------
def route_groups_through_bulk() -> None:
    """Once per process: eligible groups of apps with celery-prio installed take the bulk path."""
    original = group.apply_async
    if _ours(original):
        return

    def apply_async(
        self: group,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        add_to_parent: bool = True,
        **options: object,
    ) -> GroupResult:
        eligible = bulk_call_of(self, args, kwargs, options)
        if eligible is None:
            return original(self, args, kwargs, add_to_parent=add_to_parent, **options)
        name, tier = eligible
        return publish_group(self, name, tier, add_to_parent)

    group.apply_async = _marked(functools.wraps(original)(apply_async), original)  # type: ignore[method-assign]


def lift_canvases() -> None:
    """Once per process: chains and chords lift their steps as they are published."""
    for cls in (ChainSignature, chord):
        original = cls.apply_async
        if _ours(original):
            continue

        def apply_async(
            self: Signature, *args: object, _original: Callable[..., AsyncResult] = original, **kwargs: object
        ) -> AsyncResult:
            lift_before_publish(self, args, kwargs)
            return _original(self, *args, **kwargs)

        cls.apply_async = _marked(functools.wraps(original)(apply_async), original)  # type: ignore[method-assign]


# -- 6. publishes --------------------------------------------------------------------------------------------
def guard_send_task(app: Celery, runtime: Prio, current_settings: Callable[[], PrioSettings]) -> None:
    """Wrap ``app.send_task``: ``current_settings()`` first (it applies ``install()`` again if the app's
    configuration replaced it since), the broker's ``before_send``, and refusals turned into ``QueueFull``."""
    send_task = app.send_task
    if _ours(send_task):
        send_task = send_task.__wrapped__

    def send_task_admitted(*args: object, **kwargs: object) -> AsyncResult:
        settings = current_settings()
        before_send(runtime, kwargs)
        routed = runtime.routed.set(None)  # the router records this call's tier and queue
        try:
            return send_task(*args, **kwargs)
        except OperationalError as exc:
            full = refused(runtime, settings, exc)
            if full is None:
                raise
            raise full from None
        finally:
            runtime.routed.reset(routed)

    app.send_task = _marked(functools.wraps(send_task)(send_task_admitted), send_task)  # type: ignore[method-assign]


# -- 7. the worker's pool ------------------------------------------------------------------------------------
def notify_when_jobs_end(pool: BasePool, on_end: Callable[[bool], None]) -> None:
    """Wrap ``pool.apply_async`` so that ``on_end`` runs when a job leaves its slot: ``on_end(True)`` after its
    result callback (the task ran, whatever its outcome), ``on_end(False)`` after its error callback (the pool
    lost the job: a killed child, a hard time limit). Installed before the task strategies are built (they
    capture ``pool.apply_async``), so every request Celery runs goes through it."""
    apply_async = pool.apply_async
    if _ours(apply_async):
        return

    def notify(callback: Callable[..., object], by_result: bool) -> Callable[..., object]:
        def called(*args: object, **kwargs: object) -> object:
            try:
                return callback(*args, **kwargs)
            finally:
                on_end(by_result)

        return called

    def apply_async_notifying(
        *args: object,
        callback: Callable[..., object] | None = None,
        error_callback: Callable[..., object] | None = None,
        **kwargs: object,
    ) -> object:
        return apply_async(
            *args,
            callback=notify(callback, True) if callback else None,
            error_callback=notify(error_callback, False) if error_callback else None,
            **kwargs,
        )

    pool.apply_async = _marked(apply_async_notifying, apply_async)


# -- 8. inspect conf -----------------------------------------------------------------------------------------
def mask_in_inspect_conf(word: str) -> None:
    """``celery inspect conf`` masks settings whose names match Celery's ``HIDDEN_SETTINGS`` (KEY, PASS,
    SECRET ...); ``word`` joins that list."""
    from celery.app import utils

    if word not in utils.HIDDEN_SETTINGS.pattern:
        utils.HIDDEN_SETTINGS = re.compile(f"{utils.HIDDEN_SETTINGS.pattern}|{word}", re.IGNORECASE)


__all__ = [
    "MARK",
    "RESULT_WAITS",
    "batched_from_the_start",
    "count_result_waits",
    "guard_send_task",
    "lift_canvases",
    "mask_in_inspect_conf",
    "notify_when_jobs_end",
    "route_groups_through_bulk",
    "takes_batches",
]
