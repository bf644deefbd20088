"""Input checks shared by the tasks and the HTTP front door (no torch here)."""

from __future__ import annotations

import os
from numbers import Real
from typing import Any

import numpy as np

IMAGE_SHAPE = (8, 8)
PIXEL_MAX = 16.0  # scikit-learn's digits use 0..16
MAX_BATCH = int(os.environ.get("INFERENCE_MAX_BATCH", "4096"))


def check_image(image: Any, where: str = "image") -> np.ndarray:
    rows, cols = IMAGE_SHAPE
    if not isinstance(image, (list, tuple)):
        raise ValueError(f"{where} must be an {rows}x{cols} nested list of numbers 0..16, got {type(image).__name__}")
    if len(image) != rows:
        raise ValueError(f"{where} must have {rows} rows of {cols} numbers, got {len(image)} rows")
    for r, row in enumerate(image):
        if not isinstance(row, (list, tuple)) or len(row) != cols:
            got = f"{len(row)} values" if isinstance(row, (list, tuple)) else type(row).__name__
            raise ValueError(f"{where} row {r} must have {cols} numbers, got {got}")
        for c, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise ValueError(f"{where}[{r}][{c}] is {value!r} ({type(value).__name__}), expected a number")
            if not 0 <= value <= PIXEL_MAX or value != value:  # value != value: NaN
                raise ValueError(f"{where}[{r}][{c}] = {value!r} is out of range 0..{PIXEL_MAX:g}")
    return np.asarray(image, dtype=np.float32)


def check_batch(images: Any) -> np.ndarray:
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images must be a list of 8x8 images, got {type(images).__name__}")
    if not images:
        raise ValueError("images is empty: send at least one image")
    if len(images) > MAX_BATCH:
        raise ValueError(f"images has {len(images)} images, more than the limit of {MAX_BATCH}")
    return np.stack([check_image(img, f"images[{i}]") for i, img in enumerate(images)])
