"""Celery settings for the example app, from the environment: see ``celery_prio.example.config``.

Kept here as the configuration module a copied app starts from.
"""

from celery_prio.example.config import *  # noqa: F403
from celery_prio.example.config import celery_prio_overrides

__all__ = ["celery_prio_overrides"]
