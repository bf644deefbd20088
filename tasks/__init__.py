"""Example app: real torch inference tasks on celery-prio tiers (``celery -A tasks worker``)."""

from .app import app

__all__ = ["app"]
