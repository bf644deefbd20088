"""``group(...)`` and ``task.chunks(...)`` through the bulk path, where Celery's semantics allow.

A group of many calls of one task is what a batch job looks like in Celery
(``task.chunks`` builds exactly that: a group of ``celery.starmap`` calls).
Celery publishes it one message at a time; here such a group goes through
``celery_prio.bulk`` instead: same messages (each with its ``group`` id and
``group_index``), same ``GroupResult``, a chunk per round trip.

Eligible when every member is a plain signature of the same task with the
same keyword arguments and no options but ``tier``, the task has a tier (from
the call, the task or ``prio_routes``: an un-tiered task is left to the
user's own routes), the group has at least ``BULK_GROUP_MIN`` members, and
nothing else rides on the call (no partial args, no chord, no links, not
eager). Anything else keeps Celery's own path,
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from celery import Signature, group

from ..celery_private import MapSignature
from ..runtime import publisher_of, settings_for
from ..tiers import Tier
from .bulk import publish_calls
from .routing import tier_of_call

if TYPE_CHECKING:
    from celery.result import GroupResult

#: Smaller groups gain little from chunking: they keep Celery's path.
BULK_GROUP_MIN = 50


def bulk_call_of(
    g: group, args: Sequence[object] | None, kwargs: Mapping[str, object] | None, options: dict[str, object]
) -> tuple[str, Tier] | None:
    """``(task name, tier)`` when the group can take the bulk path, else None."""
    app = g.app
    if publisher_of(app) is None or app.conf.task_always_eager:
        return None
    # route_name: task.chunks() routes its starmap calls by the chunked task's name.
    if args or kwargs or set(options) - {"tier", "route_name"} or set(g.options) - {"tier"}:
        return None
    tasks = list(g.tasks)  # a regen for task.chunks(); Celery evaluates it the same way
    if len(tasks) < BULK_GROUP_MIN:
        return None
    first = tasks[0]
    for sig in tasks:
        mapped = isinstance(sig, MapSignature)
        if not isinstance(sig, Signature) or (type(sig) is not Signature and not mapped):
            return None  # chains, groups, chords inside: Celery's path
        if sig.task != first.task or set(sig.options) - {"tier"}:
            return None
        if sig.options.get("tier") != first.options.get("tier") or (not mapped and sig.kwargs != first.kwargs):
            return None
    if first.task not in app.tasks:
        return None
    name = options.get("route_name") or first.task
    explicit = options.get("tier") or g.options.get("tier") or first.options.get("tier")
    tier = tier_of_call(settings_for(app), name, explicit, app.tasks.get(name))
    if tier is None:
        return None  # no tier named: the user's own routes decide, on Celery's path
    return first.task, tier


def _call(sig: Signature) -> tuple[tuple[object, ...], dict[str, object]]:
    if isinstance(sig, MapSignature):  # xmap/xstarmap: Celery sends the iterable as a list
        return (), {"task": sig.kwargs["task"], "it": list(sig.kwargs["it"])}
    return tuple(sig.args), dict(sig.kwargs)


def publish_group(g: group, name: str, tier: Tier, add_to_parent: bool) -> GroupResult:
    """Publish an eligible group (``bulk_call_of``) through the bulk path; Celery's ``GroupResult`` of it."""
    app = g.app
    ids = publish_calls(app.tasks[name], (_call(sig) for sig in g.tasks), tier, 1000, {}, group=True)
    result = app.GroupResult(ids.group_id, ids.results())
    parent = app.current_worker_task
    if add_to_parent and parent:
        parent.add_trail(result)
    return result
