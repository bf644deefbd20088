"""A ``prio_subqueue_key`` for the tests: one sub-queue per task name (as one per tenant id would be)."""

from __future__ import annotations

from typing import Any


def tenant_of(task_name: str, args: Any, kwargs: Any, options: Any) -> str | None:
    return task_name.replace(".", "-") if task_name == "t.sleep" else None
