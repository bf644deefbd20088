"""The example app: real torch inference tasks on celery-prio tiers.

``celery -A celery_prio.example worker`` (or ``-A tasks`` from a checkout).
Shipped inside the package so that ``celery-prio demo`` runs from a plain
``pip install 'celery-prio[demo]'``; the library itself never imports it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Built on first use: importing one module of the example (the model, the
    # checks) does not create the Celery app.
    if name == "app":
        from .app import app

        return app
    raise AttributeError(name)
