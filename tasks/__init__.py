"""The example app module: ``celery -A tasks worker``.

The example's code lives in ``celery_prio.example`` (installed with the
package, so ``celery-prio demo`` works from ``pip install 'celery-prio[demo]'``
as well as from this checkout). Start your own app by copying that folder:
``celery_prio/example/app.py`` is the whole of the celery-prio wiring.
"""

from celery_prio.example.app import app

__all__ = ["app"]
