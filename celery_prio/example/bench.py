"""Batch inference vs a loop of single-image forwards, same process, printed as a ratio.

python -m celery_prio.example.bench [--images 2048] [--micro-batch 256]
"""

from __future__ import annotations

from celery_prio.extras import require

require("demo", "python -m celery_prio.example.bench")

import argparse
import time

from . import predict
from .model import held_out_split


def measure(n: int, micro_batch: int) -> dict[str, float]:
    _, x, _, _ = held_out_split()
    images = (x.tolist() * (n // len(x) + 1))[:n]
    predict.classify_batch(images[:micro_batch], micro_batch)  # load the model, warm up
    started = time.perf_counter()
    predict.classify_batch(images, micro_batch)
    batched = n / (time.perf_counter() - started)
    started = time.perf_counter()
    for image in images:
        predict.classify(image)
    single = n / (time.perf_counter() - started)
    _, device = predict.model_and_device()
    return {"device": str(device), "batched_per_s": batched, "single_per_s": single, "ratio": batched / single}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_prio.example.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=predict.MICRO_BATCH)
    args = parser.parse_args(argv)
    r = measure(args.images, args.micro_batch)
    print(
        f"{args.images} images on {r['device']}: classify_batch {r['batched_per_s']:.0f} images/s, "
        f"loop of classify {r['single_per_s']:.0f} images/s, ratio {r['ratio']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
