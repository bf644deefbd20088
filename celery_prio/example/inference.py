"""The inference tasks (names are the public contract; JSON in and out).

Thin Celery wrappers around ``predict``; torch is imported by that
module, so only processes that run these tasks load it.
"""

from __future__ import annotations

import time
from typing import Any

import celery_prio

from .app import app

#: Waiting online requests served by one forward pass: at most 32, waiting at most 5 ms for the batch to fill.
CLASSIFY_BATCH = celery_prio.Batch(max_size=32, max_delay=0.005)


@app.task(name="tasks.inference.classify", tier="realtime", batch=CLASSIFY_BATCH)
def classify(calls: list[celery_prio.Call]) -> list[Any]:
    """One 8x8 image (0..16) per call -> {"label", "probabilities"}; the calls waiting together go through the
    model as one batch. A call with a bad image fails alone, with the ValueError that says what is wrong."""
    from . import predict

    return predict.classify_calls([call.args[0] if call.args else call.kwargs.get("image") for call in calls])


@app.task(bind=True, name="tasks.inference.classify_batch", tier="batch")
def classify_batch(
    self: Any, images: list[list[list[float]]], start: int = 0, done: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Many images, real batched forward passes in micro-batches; results in order.

    Sliced at micro-batch granularity: between two micro-batches the task
    gives its GPU back to waiting realtime work and resumes at ``start`` with
    the predictions so far in ``done`` (callers pass only ``images``).
    """
    from . import predict

    batch = predict.check_batch(images)
    done = [] if done is None else done
    step = predict.MICRO_BATCH
    for first in celery_prio.slices(self, range(start, len(batch), step), resume="start", carry={"done": done}):
        done.extend(predict.classify_chunk(batch[first : first + step]))
    return done


@app.task(bind=True, name="tasks.inference.evaluate", tier="offline")
def evaluate(self: Any, start: int = 0, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Accuracy, per-class accuracy and confusion matrix on the held-out split (sliced like classify_batch)."""
    from . import predict

    images, _ = predict.evaluation_split()
    state = {"predicted": [], "seconds": 0.0} if state is None else state
    step = predict.MICRO_BATCH
    for first in celery_prio.slices(self, range(start, len(images), step), resume="start", carry={"state": state}):
        started = time.perf_counter()
        state["predicted"].extend(predict.predict_labels(images[first : first + step]))
        state["seconds"] += time.perf_counter() - started
    return predict.evaluation_report(state["predicted"], state["seconds"])
