"""GPU pinning for prefork workers: ``celery -A tasks worker --gpus 0,1``.

The worker (or ``CELERY_PRIO_GPUS``) names the GPUs; each pool child takes
one, round robin by its pool index, by narrowing ``CUDA_VISIBLE_DEVICES``
before it touches CUDA (the parent never does, so forking stays safe). GPU
numbers are positions in the worker's own ``CUDA_VISIBLE_DEVICES`` when that
is set. Without CUDA every process runs on the CPU and says so once.
Each process records its device (and, see ``warmup``, its model load and
warm-up times) so that ``celery inspect stats`` can show it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click
from celery import bootsteps

logger = logging.getLogger(__name__)
GPUS_ENV = "CELERY_PRIO_GPUS"


def parse_gpus(value: str | None) -> list[str]:
    if not value:
        return []
    gpus = [g.strip() for g in value.split(",") if g.strip()]
    for g in gpus:
        if not g.isdigit():
            raise click.BadParameter(f"--gpus takes GPU numbers like 0,1; got {value!r}")
    return gpus


def devices_dir(parent_pid: int) -> Path:
    """Where the pool processes of worker ``parent_pid`` record their device and warm-up figures."""
    return Path(tempfile.gettempdir()) / f"celery-prio-devices-{parent_pid}"


def pin_this_process(index: int) -> str | None:
    """Narrow CUDA_VISIBLE_DEVICES to this process's GPU (before CUDA is initialised)."""
    gpus = parse_gpus(os.environ.get(GPUS_ENV))
    if not gpus:
        return None
    chosen = gpus[index % len(gpus)]
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = visible[int(chosen)] if visible and int(chosen) < len(visible) else chosen
    os.environ["CUDA_VISIBLE_DEVICES"] = physical
    return physical


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


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


class GpuPinning(bootsteps.StartStopStep):
    """Worker step: takes ``--gpus``, passes it to the pool children, reports devices."""

    def __init__(self, worker: Any, gpus: str | None = None, **options: Any) -> None:
        value = gpus or os.environ.get(GPUS_ENV)
        self.gpus = parse_gpus(value)
        if self.gpus:
            os.environ[GPUS_ENV] = ",".join(self.gpus)  # inherited by forked children
        os.environ["CELERY_PRIO_PARENT_PID"] = str(os.getpid())
        shutil.rmtree(devices_dir(os.getpid()), ignore_errors=True)  # a dead worker's records under a reused pid
        super().__init__(worker, **options)

    def stop(self, worker: Any) -> None:
        shutil.rmtree(devices_dir(os.getpid()), ignore_errors=True)

    def info(self, worker: Any) -> dict[str, Any]:
        devices = {}
        directory = devices_dir(os.getpid())
        if directory.is_dir():
            for path in directory.glob("*.json"):
                if _alive(path.stem):  # recycled children leave records behind
                    try:
                        devices[path.stem] = json.loads(path.read_text())
                    except ValueError:
                        continue
        return {"gpus": self.gpus or "none (CPU)", "devices": devices}


def add_gpu_pinning(app: Any) -> None:
    app.user_options["worker"].add(
        click.Option(["--gpus"], default=None, help="GPUs for this worker's pool processes, e.g. 0,1 (round robin).")
    )
    app.steps["worker"].add(GpuPinning)
