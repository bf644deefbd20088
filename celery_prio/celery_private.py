"""Celery's private names celery-prio relies on, in one place, checked against Celery 5.5, 5.6 and 5.7.

Celery has no public type for these; each is what Celery itself builds, so a
check against them is exact. ``tests/test_celery_hooks.py`` fails on a Celery
that renamed one.

* ``ChainSignature`` (``celery.canvas._chain``): what ``chain(...)`` returns;
  its public name ``chain`` is a factory that may return a plain signature.
* ``MapSignature`` (``celery.canvas._basemap``): the base of ``xmap`` and
  ``xstarmap``, which ``task.chunks()`` builds.
* ``LazyMembers`` (``celery.utils.functional._regen``): how Celery keeps a
  group's generator of members, unrolled as it publishes (celery #3021).
"""

from __future__ import annotations

from celery.canvas import _basemap as MapSignature
from celery.canvas import _chain as ChainSignature
from celery.utils.functional import _regen as LazyMembers

__all__ = ["ChainSignature", "LazyMembers", "MapSignature"]
