"""The inference tasks (names are the public contract; JSON in and out).

Thin Celery wrappers around ``predict``; torch is imported by that
module, so only processes that run these tasks load it.
"""

from __future__ import annotations

from typing import Any

from .app import app


@app.task(name="tasks.inference.classify", tier="realtime")
def classify(image: list[list[float]]) -> dict[str, Any]:
    """One 8x8 image (0..16) -> {"label", "probabilities"}."""
    from . import predict

    return predict.classify(image)


@app.task(name="tasks.inference.classify_batch", tier="batch")
def classify_batch(images: list[list[list[float]]]) -> list[dict[str, Any]]:
    """Many images, real batched forward passes in micro-batches; results in order."""
    from . import predict

    return predict.classify_batch(images)


@app.task(name="tasks.inference.evaluate", tier="offline")
def evaluate() -> dict[str, Any]:
    """Accuracy, per-class accuracy and confusion matrix on the held-out split."""
    from . import predict

    return predict.evaluate()
