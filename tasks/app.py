"""The example Celery app: ``celery -A tasks worker [--gpus 0,1]``."""

from __future__ import annotations

from celery import Celery

import celery_prio
from config.celery import prio_settings

from .gpu import add_gpu_pinning

app = Celery("tasks", include=["tasks.inference"])
app.config_from_object("config.celery")
celery_prio.install(app, **prio_settings())
add_gpu_pinning(app)
