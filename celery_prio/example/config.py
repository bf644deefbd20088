"""Celery settings for ``tasks:app``, from the environment.

CELERY_BROKER_URL      broker (default redis://127.0.0.1:6379/0); amqp://... for RabbitMQ
CELERY_RESULT_BACKEND  results (default redis://127.0.0.1:6379/1)
PRIO_SETTINGS          JSON of celery-prio settings, e.g. '{"max_length": {"realtime": 500}}'
Credentials stay in these URLs; Celery masks passwords in its logs.
"""

from __future__ import annotations

import json
import os

broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
result_backend = os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/1")

# JSON only: no pickle from the network.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]

# Inference tasks are idempotent: ack after they ran, so a worker that dies
# mid-task (OOM, preemption) loses nothing; its messages go back to the queue.
task_acks_late = True
task_reject_on_worker_lost = True
result_expires = 3600
broker_connection_retry_on_startup = True
worker_hijack_root_logger = False


def celery_prio_overrides() -> dict:
    """celery-prio overrides from PRIO_SETTINGS (validated by install())."""
    raw = os.environ.get("PRIO_SETTINGS", "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"PRIO_SETTINGS is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"PRIO_SETTINGS must be a JSON object of settings, got {raw!r}")
    return value
