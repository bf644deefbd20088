"""The data: scikit-learn's 8x8 digits (they ship inside the package; no download)."""

from __future__ import annotations

import numpy as np

SEED = 1234


def held_out_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train / held-out split of scikit-learn's digits (ships with the package)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)
