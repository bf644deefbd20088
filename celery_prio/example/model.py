"""The example model: a small CNN for scikit-learn's 8x8 digits, and the model registry.

A model is a name -> loader. ``digits`` is the CNN trained by ``tasks/train.py``
(weights committed in ``tasks/weights``); set ``INFERENCE_MODEL`` to a
TorchScript file to serve your own model with the same tasks (it must take a
``(N, 1, 8, 8)`` float tensor and return ``(N, classes)`` logits).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .checks import IMAGE_SHAPE, PIXEL_MAX
from .data import held_out_split

__all__ = ["IMAGE_SHAPE", "PIXEL_MAX", "DigitsCNN", "held_out_split", "load_model"]

WEIGHTS = Path(__file__).parent / "weights" / "digits_cnn.pt"


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits_cnn() -> nn.Module:
    model = DigitsCNN()
    model.load_state_dict(torch.load(WEIGHTS, map_location="cpu", weights_only=True))
    return model


def load_torchscript(path: str) -> nn.Module:
    return torch.jit.load(path, map_location="cpu")


MODELS: dict[str, Callable[[], nn.Module]] = {"digits": load_digits_cnn}


def load_model(name: str | None = None) -> nn.Module:
    """The model named by ``name`` or ``INFERENCE_MODEL``: a registry name or a TorchScript path."""
    name = name or os.environ.get("INFERENCE_MODEL", "digits")
    if name in MODELS:
        return MODELS[name]()
    if Path(name).is_file():
        return load_torchscript(name)
    raise ValueError(f"unknown model {name!r}: use one of {sorted(MODELS)} or a TorchScript file path")
