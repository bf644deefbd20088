"""The example Celery app: ``celery -A tasks worker [--gpus 0,1]``."""

from __future__ import annotations

import os

from celery import Celery

import celery_prio
from config.celery import celery_prio_overrides

from .gpu import add_gpu_pinning
from .warmup import add_model_warmup

app = Celery("tasks", include=["tasks.inference"])
app.config_from_object("config.celery")
if os.environ.get("TASKS_PLAIN_CELERY") == "1":
    # The demo's baseline: the same tasks and workers on one plain FIFO queue.
    app.conf.task_default_queue = os.environ.get("TASKS_PLAIN_QUEUE", "celery")
else:
    celery_prio.install(app, **celery_prio_overrides())
add_gpu_pinning(app)
add_model_warmup(app)
