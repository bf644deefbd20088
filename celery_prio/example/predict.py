"""Input checks and forward passes; no Celery here. One model per process.

Bad input raises ``ValueError`` saying exactly what is wrong (the Celery task
then fails with it and the worker keeps serving).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from .checks import check_batch, check_image
from .gpu import process_device
from .model import IMAGE_SHAPE, PIXEL_MAX, held_out_split, load_model

MICRO_BATCH = int(os.environ.get("INFERENCE_MICRO_BATCH", "256"))

_loaded: tuple[torch.nn.Module, torch.device] | None = None
_device_record: dict[str, Any] = {}


def model_and_device() -> tuple[torch.nn.Module, torch.device]:
    """Load once per worker process (not per task), in eval mode, on the pinned device."""
    global _loaded
    if _loaded is None:
        device, record = process_device()
        model = load_model().to(device).eval()
        _device_record.update(record)
        _loaded = (model, device)
    return _loaded


def warm_up() -> dict[str, Any]:
    """Load the model and run it once on one image and one micro-batch: the first request pays nothing.

    Returns the device and the seconds each step took (shown by ``inspect stats``).
    """
    started = time.perf_counter()
    model_and_device()
    loaded = time.perf_counter()
    for n in (1, MICRO_BATCH):  # both shapes a task sends: kernels chosen and memory reserved now
        forward(np.zeros((n, *IMAGE_SHAPE), dtype=np.float32))
    warm = time.perf_counter()
    return {**_device_record, "load_s": round(loaded - started, 4), "warmup_s": round(warm - loaded, 4)}


def forward(batch: np.ndarray) -> np.ndarray:
    """Probabilities (N, classes) for a (N, 8, 8) batch of 0..16 pixels."""
    model, device = model_and_device()
    x = torch.from_numpy(batch / PIXEL_MAX).unsqueeze(1).to(device)
    with torch.inference_mode():
        logits = model(x)
    if logits.ndim != 2 or logits.shape[0] != len(batch):
        raise ValueError(f"model returned shape {tuple(logits.shape)}, expected ({len(batch)}, classes)")
    return torch.softmax(logits.float(), dim=1).cpu().numpy()


def as_prediction(probabilities: np.ndarray) -> dict[str, Any]:
    return {"label": int(probabilities.argmax()), "probabilities": [round(float(p), 6) for p in probabilities]}


def classify(image: Any) -> dict[str, Any]:
    return as_prediction(forward(check_image(image)[None])[0])


def classify_calls(images: list[Any]) -> list[Any]:
    """One prediction per image in one forward pass (a batch of online requests); a bad image gets its
    ``ValueError`` in its place instead, and the others go through."""
    checked: list[Any] = []
    for image in images:
        try:
            checked.append(check_image(image))
        except ValueError as exc:
            checked.append(exc)
    good = [x for x in checked if not isinstance(x, ValueError)]
    predictions = iter(classify_chunk(np.stack(good)) if good else [])
    return [x if isinstance(x, ValueError) else next(predictions) for x in checked]


def classify_batch(images: Any, micro_batch: int = MICRO_BATCH) -> list[dict[str, Any]]:
    batch = check_batch(images)
    out: list[dict[str, Any]] = []
    for start in range(0, len(batch), micro_batch):  # bounded memory on the device
        out.extend(classify_chunk(batch[start : start + micro_batch]))
    return out


def classify_chunk(batch: np.ndarray) -> list[dict[str, Any]]:
    """One micro-batch of checked images: one forward pass."""
    return [as_prediction(p) for p in forward(batch)]


def evaluation_split() -> tuple[np.ndarray, np.ndarray]:
    """The held-out images and labels ``evaluate`` scores."""
    _, x_test, _, y_test = held_out_split()
    return x_test, y_test


def predict_labels(images: np.ndarray) -> list[int]:
    return [int(label) for label in forward(images).argmax(1)]


def evaluate() -> dict[str, Any]:
    started = time.perf_counter()
    x_test, _ = evaluation_split()
    predicted: list[int] = []
    for i in range(0, len(x_test), MICRO_BATCH):
        predicted.extend(predict_labels(x_test[i : i + MICRO_BATCH]))
    return evaluation_report(predicted, time.perf_counter() - started)


def evaluation_report(predicted: list[int], seconds: float) -> dict[str, Any]:
    """Accuracy, per-class accuracy and confusion matrix of ``predicted`` against the held-out labels."""
    _, y_test = evaluation_split()
    guesses = np.asarray(predicted)
    classes = 10
    confusion = np.zeros((classes, classes), dtype=int)
    for truth, guess in zip(y_test, guesses, strict=True):
        confusion[truth, guess] += 1
    per_class = {str(c): round(float(confusion[c, c] / max(confusion[c].sum(), 1)), 4) for c in range(classes)}
    return {
        "accuracy": round(float((guesses == y_test).mean()), 4),
        "n": len(y_test),
        "per_class": per_class,
        "confusion_matrix": confusion.tolist(),
        "seconds": round(seconds, 4),
    }
