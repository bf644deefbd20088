"""Train the digits CNN and write ``celery_prio/example/weights/digits_cnn.pt``.

    python -m celery_prio.example.train [--out PATH]

Fixed seed, CPU, a few seconds. Prints held-out accuracy (must be >= 0.95).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from celery_prio.extras import require

require("demo", "python -m celery_prio.example.train")

import torch
from torch import nn

from .data import SEED
from .model import PIXEL_MAX, WEIGHTS, DigitsCNN, held_out_split


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(prog="python -m celery_prio.example.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"where to write the weights (default {WEIGHTS})")
    out = parser.parse_args(argv).out
    torch.manual_seed(SEED)
    x_train, x_test, y_train, y_test = held_out_split()
    xt = torch.from_numpy(x_train / PIXEL_MAX).unsqueeze(1)
    yt = torch.from_numpy(y_train).long()
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    for _epoch in range(30):
        order = torch.randperm(len(xt))
        for i in range(0, len(xt), 64):
            idx = order[i : i + 64]
            optimizer.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            optimizer.step()
    model.eval()
    with torch.inference_mode():
        predicted = model(torch.from_numpy(x_test / PIXEL_MAX).unsqueeze(1)).argmax(1).numpy()
    accuracy = float((predicted == y_test).mean())
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    print(f"held-out accuracy {accuracy:.4f} on {len(y_test)} images; weights -> {out}")
    return accuracy


if __name__ == "__main__":
    main()
