"""The example Celery app: ``celery -A tasks worker [--gpus 0,1]`` (or ``-A celery_prio.example``)."""

from __future__ import annotations

import os

from celery import Celery

import celery_prio

from .config import celery_prio_overrides
from .gpu import add_gpu_pinning
from .plain import batches_of_one
from .warmup import add_model_warmup

app = Celery("tasks", include=["celery_prio.example.inference"])
app.config_from_object("celery_prio.example.config")
if os.environ.get("TASKS_PLAIN_CELERY") == "1":
    # The demo's baseline: the same tasks and workers on one plain FIFO queue. Plain Celery runs a batched
    # task (classify) one call at a time: its function gets a batch of one.
    app.conf.task_default_queue = os.environ.get("TASKS_PLAIN_QUEUE", "celery")
    app.on_after_finalize.connect(batches_of_one, weak=False)
else:
    celery_prio.install(app, **celery_prio_overrides())
add_gpu_pinning(app)
add_model_warmup(app)
