"""Warm pool processes: the model is loaded and run once before a process takes a task.

The first request after a worker start, a scale-up or a child recycle
(``worker_max_tasks_per_child``) must not pay the model load: each pool child
loads the model on its pinned device and runs one forward pass in
``worker_process_init``, before billiard hands it a job. The worker step
below waits, before the worker says ``ready.`` and answers ``inspect ping``,
until every child of the starting pool is warm, so readiness means warm.

A child whose model fails to load (missing or corrupt weights, a wrong
``INFERENCE_MODEL``, a CUDA error) records what went wrong: at start the
worker stops with that message; later (a recycled child) the child asks the
worker for a warm shutdown instead of failing every task it would get.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from celery import bootsteps, signals

from ..worker.gpus import PARENT_ENV, devices_dir, pin_this_process, record_device

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT = float(os.environ.get("INFERENCE_WARMUP_TIMEOUT", "180"))
READY_MARK = "warm"  # written in the records folder once the starting pool is warm


class ModelLoadError(RuntimeError):
    """The model could not be loaded or run once; the message says which process and why."""


def record_path(parent: int, pid: int) -> Path:
    return devices_dir(parent) / f"{pid}.json"


def warm_this_process() -> dict[str, Any]:
    """Load the model on this process's device and run one forward pass; the figures for ``inspect stats``."""
    started = time.perf_counter()
    from . import predict  # torch is imported here, in the process that runs tasks

    imported = time.perf_counter() - started
    return {**predict.warm_up(), "import_s": round(imported, 4)}


def _write_record(record: dict[str, Any]) -> None:
    record_device(**record)  # next to the GPU the library pinned this process to


@signals.worker_process_init.connect
def _warm_pool_child(**_: Any) -> None:
    from billiard.process import current_process

    index = getattr(current_process(), "index", 0) or 0
    pin_this_process(index)  # the library's own handler did, unless this one ran first (idempotent)
    try:
        record = warm_this_process()
    except Exception as exc:  # recorded for the worker, which stops: never a worker that fails every task
        message = f"pool process {os.getpid()} could not load the model: {exc.__class__.__name__}: {exc}"
        logger.critical("celery-prio example: %s", message)
        _write_record({"error": message})
        parent = os.environ.get(PARENT_ENV)
        # At start the worker's own wait reports the error; later (a recycled
        # child) nobody waits, so the child asks its worker for a warm shutdown.
        if parent and int(parent) == os.getppid() and (devices_dir(int(parent)) / READY_MARK).exists():
            os.kill(int(parent), signal.SIGTERM)  # running tasks finish
        os._exit(1)
    _write_record(record)
    logger.info(
        "celery-prio example: pool process %d warm on %s (load %.3f s, warm-up %.3f s)",
        index,
        record["device"],
        record["load_s"],
        record["warmup_s"],
    )


class ModelWarmup(bootsteps.StartStopStep):
    """Worker step, after the pool: the worker is ready only when its processes are warm.

    Prefork: waits for each child's record (written by ``_warm_pool_child``).
    Solo and threads pools run tasks in the worker process itself: it warms
    up here.
    """

    requires = ("celery.worker.components:Pool",)

    def start(self, worker: Any) -> None:
        started = time.monotonic()
        if worker.pool_cls.__module__.endswith("prefork"):
            self._wait_for_children(worker, started)
        else:
            try:
                _write_record(warm_this_process())
            except Exception as exc:
                raise ModelLoadError(f"could not load the model: {exc.__class__.__name__}: {exc}") from exc
        devices_dir(os.getpid()).mkdir(exist_ok=True)
        (devices_dir(os.getpid()) / READY_MARK).touch()
        logger.info("celery-prio example: model warm in every pool process (%.2f s)", time.monotonic() - started)

    def _wait_for_children(self, worker: Any, started: float) -> None:
        directory = devices_dir(os.getpid())
        expected = worker.concurrency
        while True:
            records = []
            for path in directory.glob("*.json") if directory.is_dir() else ():
                try:
                    records.append(json.loads(path.read_text()))
                except ValueError:
                    continue  # being written
            errors = [r["error"] for r in records if "error" in r]
            if errors:
                raise ModelLoadError(errors[0])
            if len(records) >= expected:
                return
            if time.monotonic() - started > WARMUP_TIMEOUT:
                raise ModelLoadError(
                    f"only {len(records)} of {expected} pool processes warmed up within {WARMUP_TIMEOUT:.0f} s "
                    "(INFERENCE_WARMUP_TIMEOUT)"
                )
            time.sleep(0.05)


def add_model_warmup(app: Any) -> None:
    app.steps["worker"].add(ModelWarmup)
