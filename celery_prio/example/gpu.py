"""The example's GPU side: ``celery -A tasks worker --gpus 0,1`` and the torch device of a pool process.

Pinning itself is the library's (``celery_prio.worker.gpus``: ``--prio-gpus``,
``prio_gpus`` or ``CELERY_PRIO_GPUS``, one GPU per pool process, round robin);
the example keeps ``--gpus`` as a shorter name for the same option. Without
CUDA every process runs on the CPU and says so once. Each process records
its device (and, see ``warmup``, its model load and warm-up times) so that
``celery inspect stats`` can show it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import click

from ..worker.gpus import GPUS_ENV, GpuPinning, devices_dir, parse_gpus, pin_this_process

logger = logging.getLogger(__name__)


def process_device() -> tuple[Any, dict[str, Any]]:
    """The torch device of this process and a description of it (torch imported lazily: the parent never loads CUDA)."""
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda:0")  # the one GPU pinning left visible
        name = torch.cuda.get_device_name(0)
    else:
        device, name = torch.device("cpu"), "cpu"
        logger.info("celery-prio: no CUDA device, running on the CPU (pid %d)", os.getpid())
    return device, {"device": str(device), "name": name, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def add_gpu_pinning(app: Any) -> None:
    """``--gpus``: the example's name for ``--prio-gpus``, and the pinning step (``install()`` adds it too; the
    demo's plain-Celery run has no ``install()`` and pins and warms its processes the same way)."""
    app.user_options["worker"].add(
        click.Option(["--gpus"], default=None, help="GPUs for this worker's pool processes, e.g. 0,1 (round robin).")
    )
    app.steps["worker"].add(GpuPinning)


__all__ = ["GPUS_ENV", "add_gpu_pinning", "devices_dir", "parse_gpus", "pin_this_process", "process_device"]
