"""GPU-pinned workers: ``celery -A app worker --prio-gpus 0,1`` (or ``prio_gpus``, or ``CELERY_PRIO_GPUS``).

Each prefork pool process takes one of the worker's GPUs, round robin by its
pool index, by narrowing ``CUDA_VISIBLE_DEVICES`` in ``worker_process_init``,
before anything in it touches CUDA (the worker process itself never does, so
forking stays safe). GPU numbers are positions in the worker's own
``CUDA_VISIBLE_DEVICES`` when that is set (a container that sees GPUs 4,5,6
pins ``--prio-gpus 1`` to physical GPU 5). ``-P solo`` and ``-P threads`` run
tasks in the worker process: it takes the first GPU. Each process records
its GPU, and ``celery inspect stats`` shows them (``gpus``, and ``devices``
by pool process id).

Why it lives in the library: one process per GPU (with slices and batching)
or several processes per GPU (with a reserved realtime slot) is a choice an
adopting app makes at deploy time, per queue (``-Q``), without code of its
own (``docs/guides/gpus.md``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals

from ..settings import checks

if TYPE_CHECKING:
    from celery import Celery
    from celery.worker import WorkController

logger = logging.getLogger(__name__)

#: The worker's GPUs, as pool processes inherit them (set by the worker step from its option or setting).
GPUS_ENV = "CELERY_PRIO_GPUS"
#: The worker process's pid, for its pool processes' device records.
PARENT_ENV = "CELERY_PRIO_PARENT_PID"
#: The pid that pinned itself already: pinning twice would index into the narrowed list.
PINNED_ENV = "CELERY_PRIO_PINNED_PID"


def parse_gpus(value: Any) -> list[str]:
    """``"0,1"`` or ``[0, 1]`` -> ``["0", "1"]``; ``ConfigError`` naming the value for anything else."""
    return list(checks.gpus(value))


def worker_gpus() -> list[str]:
    """The GPUs this worker hands its pool processes (``--prio-gpus``); empty where it pins none."""
    try:
        return parse_gpus(os.environ.get(GPUS_ENV))
    except ValueError:  # the worker refused a bad value at start; a report must not fail on it
        return []


def devices_dir(parent_pid: int) -> Path:
    """Where the pool processes of worker ``parent_pid`` record their GPU (and, in the example, warm-up)."""
    return Path(tempfile.gettempdir()) / f"celery-prio-devices-{parent_pid}"


def pin_this_process(index: int) -> str | None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this process's GPU; its physical number, None without GPUs.
    Idempotent in one process."""
    if os.environ.get(PINNED_ENV) == str(os.getpid()):
        return os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = parse_gpus(os.environ.get(GPUS_ENV))
    if not gpus:
        return None
    chosen = gpus[index % len(gpus)]
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = visible[int(chosen)] if visible and int(chosen) < len(visible) else chosen
    os.environ["CUDA_VISIBLE_DEVICES"] = physical
    os.environ[PINNED_ENV] = str(os.getpid())
    return physical


def record_device(**figures: Any) -> None:
    """Add ``figures`` to this process's record (read by ``inspect stats``)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    path = devices_dir(int(parent)) / f"{os.getpid()}.json"
    path.parent.mkdir(exist_ok=True)
    try:
        record = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        record = {}
    path.write_text(json.dumps({**record, **figures}))


@signals.worker_process_init.connect(weak=False)
def _pin_pool_process(**_: object) -> None:
    from billiard.process import current_process

    index = getattr(current_process(), "index", 0) or 0
    physical = pin_this_process(index)
    if physical is not None:
        logger.info("celery-prio: pool process %d pinned to GPU %s", index, physical)
        record_device(cuda_visible_devices=physical, pool_index=index)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


class GpuPinning(bootsteps.StartStopStep):
    """Worker step: takes ``--prio-gpus`` (else ``prio_gpus``, else ``CELERY_PRIO_GPUS``), hands the GPUs to the
    pool processes, and reports each one's device in ``inspect stats``."""

    def __init__(
        self, worker: WorkController, prio_gpus: str | None = None, gpus: str | None = None, **options: object
    ) -> None:
        setting = getattr(getattr(worker, "app", None), "conf", {}).get("prio_gpus")
        self.gpus = parse_gpus(prio_gpus or gpus or setting or os.environ.get(GPUS_ENV))
        if self.gpus:
            os.environ[GPUS_ENV] = ",".join(self.gpus)  # inherited by forked pool processes
            if not getattr(worker.pool_cls, "__module__", "").endswith("prefork"):  # tasks run in this process
                pin_this_process(0)
        os.environ[PARENT_ENV] = str(os.getpid())
        shutil.rmtree(devices_dir(os.getpid()), ignore_errors=True)  # a dead worker's records under a reused pid
        super().__init__(worker, **options)

    def stop(self, worker: WorkController) -> None:
        shutil.rmtree(devices_dir(os.getpid()), ignore_errors=True)

    def info(self, worker: WorkController) -> dict[str, Any]:
        devices = {}
        directory = devices_dir(os.getpid())
        for path in directory.glob("*.json") if directory.is_dir() else ():
            if _alive(path.stem):  # recycled processes leave records behind
                try:
                    devices[path.stem] = json.loads(path.read_text())
                except ValueError:
                    continue
        return {"gpus": self.gpus or "none (CPU)", "devices": devices}


def add_worker_option(app: Celery) -> None:
    """``install()``: the worker takes ``--prio-gpus`` and runs the pinning step (idempotent)."""
    import click

    options = app.user_options["worker"]
    if not any("--prio-gpus" in getattr(o, "opts", ()) for o in options):
        options.add(
            click.Option(
                ["--prio-gpus"],
                default=None,
                help="celery-prio: GPUs for this worker's pool processes, e.g. 0,1 (one each, round robin).",
            )
        )
    app.steps["worker"].add(GpuPinning)


__all__ = ["GPUS_ENV", "GpuPinning", "add_worker_option", "devices_dir", "parse_gpus", "pin_this_process"]
