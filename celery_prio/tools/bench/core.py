"""What every benchmark part shares: brokers, the mixed workload, a run of real workers, percentiles."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ...brokers import adapter_for
from ...errors import QueueFull
from ..benchapp import NATIVE_PRIORITY, make_app
from ..workers import WorkerProcess

#: The benchmark's Redis (broker, and where workers record what ran); PRIO_BENCH_REDIS points it elsewhere
#: (``python -m celery_prio.example.gpu_check --batching`` starts one of its own on a GPU machine).
BENCH_REDIS = os.environ.get("PRIO_BENCH_REDIS", "redis://127.0.0.1:6379/14")
BROKER_URLS = {"redis": BENCH_REDIS, "amqp": "amqp://guest:guest@127.0.0.1:5672//"}

RECORD_URL = BENCH_REDIS

NO_CAPS = {"realtime": None, "batch": None, "offline": None}

AGING_OFF = {"batch": None, "offline": None}

AGING_ON = {"batch": None, "offline": 3}

#: The overload mix the first version was measured with: realtime 40/s next to a saturating batch stream.
DEFAULTS_RT_RATE = 40.0

AGING_OFFLINE_RATE = 1.5  # above what offline's own share drains (about one 1 s task a second here)


@dataclass
class Workload:
    duration: float = 20.0
    concurrency: int = 4
    rt_rate: float = 30.0  # realtime requests per second (Poisson)
    rt_seconds: float = 0.02
    batch_seconds: float = 0.1
    offline_seconds: float = 2.0
    offline_backlog: int = 20
    offline_rate: float = 0.0  # offline tasks per second arriving during the run (Poisson)
    grace: float = 3.0  # how long realtime stragglers may finish after the stream
    seed: int = 7
    batch_load: float = 1.5  # batch backlog as slot-time over the run's slot-time (0: realtime alone)

    @property
    def batch_backlog(self) -> int:
        # Enough batch work to keep every slot busy for the whole run.
        return math.ceil(self.batch_load * self.concurrency * self.duration / self.batch_seconds)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def broker_kind(url: str) -> str:
    return "redis" if url.startswith("redis") else "amqp"


class Run:
    """One benchmark setup: its app (client side), its worker and its queues."""

    def __init__(
        self, mode: str, broker: str, logdir: Path, concurrency: int, tier_on: str = "call", **app_options: Any
    ) -> None:
        self.mode, self.broker = mode, broker
        self.tier_on = tier_on  # celery-prio: "call" (apply_async(tier=...)) or "decorator" (@app.task(tier=...))
        self.prefix = f"bench{uuid.uuid4().hex[:8]}"
        self.app_options = app_options  # the worker builds the same app from the environment
        self.app = make_app(mode, broker, self.prefix, RECORD_URL, **app_options)
        self.task = self.app.tasks["bench.work"]
        self.kind = broker_kind(broker)
        self.records = redis.Redis.from_url(RECORD_URL)
        self.logdir, self.concurrency = logdir, concurrency
        self.worker: WorkerProcess | None = None  # the last one started
        self.workers: list[WorkerProcess] = []
        self.extra_env: dict[str, str] = {}  # more environment for its workers
        self.python: str | None = None  # its workers' interpreter (None: this one)
        self.started = 0  # workers started so far (each gets its own node name and log)
        self.raise_refusals = False  # a part that counts refusals itself (--only surge) sets it
        self.refused = 0  # publishes refused with QueueFull (celery-prio's admission): the caller knew at once

    def start_worker(self, wait: bool = True) -> None:
        env = {
            "BENCH_MODE": self.mode,
            "BENCH_BROKER": self.broker,
            "BENCH_PREFIX": self.prefix,
            "BENCH_RECORD": RECORD_URL,
            "BENCH_OPTIONS": json.dumps(self.app_options),
            "OMP_NUM_THREADS": "1",  # torch tasks (--only batching): one thread per pool process, as the demo runs
            **self.extra_env,
        }
        self.started += 1
        n = self.started
        self.worker = WorkerProcess(
            "celery_prio.tools.benchapp",
            log_path=self.logdir / f"{self.prefix}-{self.mode}-{n}.log",
            concurrency=self.concurrency,
            hostname=f"{self.mode}{n}-{self.prefix}@%h",  # distinct node names: a second worker is not the first
            env=env,
            python=self.python,
        )
        self.workers.append(self.worker)
        if wait:
            self.worker.wait_ready()

    def start(self, cold: bool) -> None:
        """The worker up, and warmed up unless ``cold`` (what a new user gets: no warm-up before the clock)."""
        self.start_worker()
        if not cold:
            self.warm_up()

    def warm_up(self) -> None:
        """One realtime task through, before the clock starts: every setup starts with its queues found.

        (A realtime task sent per call goes to its shortest-first sub-queue, which a worker finds within
        about half a second on Redis and a second on RabbitMQ; that start-up delay is not what is measured.)
        """
        sent = self.publish("realtime", 0.0, label="warm")
        deadline = time.time() + 15
        while time.time() < deadline and not any(r[0] == "warm" and r[1] == sent for r in self.read()):
            time.sleep(0.05)

    def publish(self, tier: str, seconds: float, elements: int = 0, label: str | None = None) -> float:
        """Publish one task (sliced into ``elements`` when given); returns its send time (recorded back)."""
        sent = time.time()
        kind = "sliced" if elements else "work"
        task, args = self.task, (label or tier, sent, seconds)
        if elements:
            task, args = self.app.tasks["bench.sliced"], (label or tier, sent, elements, seconds / elements)
        if self.mode == "prio":
            try:
                if self.tier_on == "decorator":
                    self.app.tasks[f"bench.{kind}_{tier}"].apply_async(args)
                else:
                    task.apply_async(args, tier=tier)
            except QueueFull:
                if self.raise_refusals:
                    raise
                self.refused += 1
        elif self.mode.startswith("native"):
            task.apply_async(args, priority=NATIVE_PRIORITY[self.kind][tier])
        else:
            task.apply_async(args)
        return sent

    def publish_task(self, task: Any, args: tuple, tier: str) -> None:
        """``task`` with ``args``: into ``tier`` under celery-prio, to its routed queue on plain Celery."""
        if self.mode == "prio":
            task.apply_async(args, tier=tier)
        else:
            task.apply_async(args)

    def read(self) -> list[tuple[str, float, float, float]]:
        rows = self.records.lrange(f"{self.prefix}:records", 0, -1)
        out = []
        for row in rows:
            tier, sent, start, end = row.decode().split()
            out.append((tier, float(sent), float(start), float(end)))
        return out

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        adapter = adapter_for(self.app)
        try:
            names = [f"{self.prefix}.{t}" for t in ("realtime", "batch", "offline", "fifo", "dead")]
            names += [f"{n}.{suffix}" for n in names[:3] for suffix in ("promoted", "dlx")]
            adapter.delete_queues(names)
            # Sub-queues, their registry and the markers of sliced tasks' continuations.
            if self.kind == "redis":
                for key in adapter.client.scan_iter(f"{self.prefix}.*"):
                    adapter.client.delete(key)
            else:  # by name: RabbitMQ as stock runs no management API to list them
                from ...runtime import settings_for

                adapter.delete_queues(adapter.app_queues(settings_for(self.app)))
        finally:
            adapter.close()
        self.records.delete(f"{self.prefix}:records")


def poisson_streams(streams: dict[str, tuple[float, Any]], t0: float, t_end: float, rng: random.Random) -> dict:
    """Call each stream's publish at Poisson arrival times (``{name: (rate, publish)}``) until ``t_end``."""
    due = {name: t0 + rng.expovariate(rate) for name, (rate, _) in streams.items()}
    sent = dict.fromkeys(streams, 0)
    while due and min(due.values()) < t_end:
        name = min(due, key=due.__getitem__)
        time.sleep(max(0.0, due[name] - time.time()))
        rate, publish = streams[name]
        publish()
        sent[name] += 1
        due[name] += rng.expovariate(rate)
    return sent


def await_realtime(run: Run, sent_rt: int, grace: float) -> tuple[float, list]:
    """Wait up to ``grace`` for the realtime stragglers; the cut-off time and the records then."""
    deadline = time.time() + grace
    while time.time() < deadline and sum(r[0] == "realtime" for r in run.read()) < sent_rt:
        time.sleep(0.1)
    return time.time(), run.read()


def run_mixed(
    mode: str, broker: str, w: Workload, logdir: Path, cold: bool = False, tier_on: str = "call", **app_options: Any
) -> dict[str, Any]:
    """``cold``: no warm-up task before the clock (what a new user gets); ``tier_on``: see ``Run``."""
    run = Run(mode, broker, logdir, w.concurrency, tier_on=tier_on, **app_options)
    try:
        run.start(cold)
        offline_sent = []
        for _ in range(w.offline_backlog):
            offline_sent.append(run.publish("offline", w.offline_seconds))
        for _ in range(w.batch_backlog):
            run.publish("batch", w.batch_seconds)
        t0 = time.time()
        t_end = t0 + w.duration
        streams = {"realtime": (w.rt_rate, lambda: run.publish("realtime", w.rt_seconds))} if w.rt_rate else {}
        if w.offline_rate:
            streams["offline"] = (
                w.offline_rate,
                lambda: offline_sent.append(run.publish("offline", w.offline_seconds)),
            )
        sent_rt = poisson_streams(streams, t0, t_end, random.Random(w.seed)).get("realtime", 0)
        if not sent_rt:
            time.sleep(max(0.0, t_end - time.time()))
        sent_rt -= run.refused  # refused at once (QueueFull): never in the queue, the caller degraded at once
        cutoff, records = await_realtime(run, sent_rt, w.grace)
    finally:
        run.close()
    summary = summarize(records, t0, t_end, cutoff, sent_rt, offline_sent, w)
    summary["realtime"]["refused"] = run.refused
    return summary


def offline_busy(records, start_at: float, end_at: float, tier_name: str = "offline") -> float:
    """Slot-seconds tasks of ``tier_name`` (offline by default) ran inside [start_at, end_at]."""
    return sum(
        min(end, end_at) - max(start, start_at)
        for tier, _, start, end in records
        if tier == tier_name and end > start_at and start < end_at
    )


def summarize(
    records, t0: float, t_end: float, cutoff: float, sent_rt: int, offline_sent: list[float], w: Workload
) -> dict[str, Any]:
    rt = [end - sent for tier, sent, _, end in records if tier == "realtime"]
    # Requests not done by the cutoff count with the latency they had then:
    # a setup cannot look better by never answering.
    rt += [cutoff - t0] * max(0, sent_rt - len(rt))
    in_window = [r for r in records if r[3] <= t_end]
    batch_done = sum(1 for r in in_window if r[0] == "batch")
    offline_done = sum(1 for r in in_window if r[0] == "offline")
    offline = [(sent, start) for tier, sent, start, _ in records if tier == "offline"]
    started = {sent for sent, _ in offline}
    # Wait = publish -> start; a task not started by the cutoff has waited until then.
    waits = [start - sent for sent, start in offline] + [cutoff - s for s in offline_sent if s not in started]
    return {
        "realtime": {
            "sent": sent_rt,
            "done": len([r for r in records if r[0] == "realtime"]),
            "p50_ms": percentile(rt, 50) * 1000,
            "p99_ms": percentile(rt, 99) * 1000,
        },
        "batch": {"done": batch_done, "per_s": batch_done / w.duration},
        "offline": {
            "done": offline_done,
            "sent": len(offline_sent),
            "busy_s": offline_busy(records, t0, t_end),
            "batch_busy_s": offline_busy(records, t0, t_end, "batch"),
            # Progress in the second half: a tier that is starved makes none there.
            "busy_late_s": offline_busy(records, t0 + (t_end - t0) / 2, t_end),
            "longest_wait_s": max(waits) if waits else 0.0,
            "p50_wait_s": percentile(waits, 50) if waits else 0.0,
        },
    }


def best_of(rounds: int, setups: dict[str, tuple[str, dict[str, Any]]], measure) -> dict[str, float]:
    """Best rate per setup over interleaved rounds: the machine's noise hits every setup alike."""
    return {name: max(values) for name, values in interleaved(rounds, setups, measure).items()}


def interleaved(rounds: int, setups: dict[str, tuple[str, dict[str, Any]]], measure) -> dict[str, list[float]]:
    """Every round's rate per setup, the setups interleaved in each round."""
    rates: dict[str, list[float]] = {name: [] for name in setups}
    names = list(setups)
    for round_ in range(rounds):
        # Rotate the order each round so that no setup always runs in the same slot.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            mode, options = setups[name]
            rates[name].append(measure(mode, **options))
    return rates


def round_ratios(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Lowest, median and highest of the per-round ratios ``ours / theirs`` (each pair ran in the same round,
    minutes apart at most: the figure a noisy host moves least)."""
    ratios = sorted(a / b for a, b in zip(ours, theirs, strict=True))
    return ratios[0], statistics.median(ratios), ratios[-1]


def management_api_answers(port: int = 15672) -> bool:
    """Whether RabbitMQ's management API answers on this machine (the stock image runs without it)."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
