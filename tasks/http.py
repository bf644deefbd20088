"""``uvicorn tasks.http:api``: the example's HTTP front door (``celery_prio.example.http``)."""

from celery_prio.example.http import api, create_api

__all__ = ["api", "create_api"]
