"""Priority inheritance at publish time: work that a higher tier waits on runs at that tier.

* **Canvas.** In a chain, every step before a higher-tier step runs at least
  at that tier (the realtime step at the end waits for all of them); in a
  chord, the header runs at least at the body's tier; groups inside chains
  and chords likewise. A signature whose call names a tier keeps the higher
  of the two. Done once, when the canvas is published: the tiers travel in
  the signatures' options, so the steps a worker publishes later (the rest
  of a chain, a chord's body) carry them too.
* **Children.** A task published by a running task, naming no tier (not on
  the call, not on the task, not in ``prio_routes``), runs at the running
  task's tier (the Temporal/Celery convention), not at the default tier.

``prio_inherit = False`` turns both off. Celery's chains and chords call
:func:`lift_before_publish` as they are published (``celery_hooks.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from celery import Signature, chord, group
from celery.utils.functional import regen

from ..celery_private import ChainSignature, LazyMembers
from ..headers import BOOSTED_HEADER
from ..policy.routes import tier_of_call
from ..runtime import runtime_of
from ..settings import PrioSettings
from ..tiers import Tier

if TYPE_CHECKING:
    from celery import Celery
    from celery.app.task import Context


def higher(a: Tier | None, b: Tier | None) -> Tier | None:
    """The more urgent of two tiers (None: no tier)."""
    if a is None or b is None:
        return a if b is None else b
    return a if a.value <= b.value else b


def own_tier(settings: PrioSettings, sig: Signature) -> Tier:
    """The tier a signature would run at by itself: its call's, its task's, ``prio_routes``, else the default."""
    task = sig.app.tasks.get(sig.task) if sig.task else None
    tier = tier_of_call(settings, sig.task or "", sig.options.get("tier"), task)
    return settings.default_tier if tier is None else tier


def lift(settings: PrioSettings, sig: Signature | dict[str, object], floor: Tier | None) -> Tier | None:
    """Raise ``sig``'s tasks to at least ``floor``; returns the most urgent tier anywhere in ``sig``."""
    if isinstance(sig, dict) and not isinstance(sig, Signature):  # a canvas member given as a plain dict
        as_signature = Signature.from_dict(sig)
        top = lift(settings, as_signature, floor)
        sig.update(as_signature)  # in place: the canvas holding the dict publishes what was lifted
        return top
    if isinstance(sig, ChainSignature):
        running = floor
        for step in reversed(sig.tasks):  # each step waits on nothing; each is waited on by all after it
            running = higher(running, lift(settings, step, running))
        return running
    if isinstance(sig, chord):
        body_tier = lift(settings, sig.body, floor) if sig.body is not None else floor
        return lift_members(settings, sig, higher(floor, body_tier), body_tier)  # the body waits on every member
    if isinstance(sig, group):
        return lift_members(settings, sig, floor, floor)
    if not isinstance(sig, Signature):
        return floor
    tier = own_tier(settings, sig)
    lifted = higher(tier, floor)
    if lifted is not tier:
        sig.options["tier"] = lifted.label  # the higher of the call's and the waiter's
    return lifted


def lift_members(settings: PrioSettings, sig: group | chord, floor: Tier | None, top: Tier | None) -> Tier | None:
    """Lift a group's or chord header's members to ``floor``; the most urgent tier among them and ``top``.

    A lazy header (a generator, which Celery keeps as a ``regen``) is never
    iterated here: Celery unrolls it incrementally as it publishes (celery
    #3021), so each member is lifted as Celery takes it. Its members' own
    tiers then do not raise the steps before it in a chain (they are not
    known yet); the floor still reaches every member.
    """
    if isinstance(sig.tasks, LazyMembers):
        members = sig.tasks
        sig.tasks = regen(_lifted_as_taken(settings, members, floor))
        return top
    for member in sig.tasks:
        top = higher(top, lift(settings, member, floor))
    return top


def _lifted_as_taken(settings: PrioSettings, members: Iterable[Signature], floor: Tier | None) -> Iterator[Signature]:
    for member in members:
        lift(settings, member, floor)
        yield member


def _inheriting(sig: Signature) -> PrioSettings | None:
    app = sig.app
    runtime = runtime_of(app)
    if runtime is None:
        return None
    return runtime.settings if runtime.settings.inherit else None


def lift_before_publish(canvas: Signature, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """A chain or chord about to be published (``apply_async(*args, **kwargs)``): lift its steps, for an app
    with celery-prio and ``prio_inherit``."""
    settings = _inheriting(canvas)
    if settings is None:
        return
    # ``chord(header)(body)`` passes the body in the call's kwargs, not in the chord.
    call_kwargs = args[1] if len(args) > 1 else kwargs.get("kwargs")
    body = call_kwargs.get("body") if isinstance(call_kwargs, dict) else None
    if isinstance(canvas, chord) and body is not None and canvas.body is None:
        lift_members(settings, canvas, lift(settings, body, None), None)
    else:
        lift(settings, canvas, None)


def _running_request() -> Context | None:
    """The request of the task running in this thread (a worker's pool child), or None outside a task."""
    from celery import current_task

    task = current_task._get_current_object() if current_task else None
    request = getattr(task, "request", None)
    if task is None or request is None or request.called_directly:
        return None
    return request


def parent_tier(settings: PrioSettings, always: bool = False) -> Tier | None:
    """The tier of the task running in this thread (None outside a task, or with ``prio_inherit`` off)."""
    if not (settings.inherit or always):
        return None
    request = _running_request()
    if request is None:
        return None
    queue = (request.delivery_info or {}).get("routing_key") or ""
    return settings.tier_for_queue(queue)


def running_task_tier(app: Celery) -> Tier | None:
    """The tier of the task running in this thread, for an app with ``install()`` (None otherwise)."""
    runtime = runtime_of(app)
    return None if runtime is None else parent_tier(runtime.settings, always=True)


def boosted_floor(settings: PrioSettings) -> Tier | None:
    """The tier a boosted running task was lifted to: what it publishes runs at least there.

    A chain's next step, a chord's body, a child: what waits on the boosted
    task waits on them too. None outside a boosted task or with ``prio_inherit`` off.
    """
    if not settings.inherit:
        return None
    request = _running_request()
    if request is None:
        return None
    headers = getattr(request, "headers", None) or {}
    if getattr(request, BOOSTED_HEADER, None) is None and BOOSTED_HEADER not in headers:
        return None
    return parent_tier(settings)
