"""Side-by-side benchmark: plain Celery (FIFO, broker-native priority) vs celery-prio.

    celery-prio bench --broker redis --broker amqp --duration 20

For each broker it runs, in one process and one after the other:

* the mixed workload through three setups on one worker (concurrency 4):
  FIFO (one queue, default prefetch), broker-native priority (prefetch 1 +
  acks_late) and celery-prio. Sleep-based tasks stand in for GPU time: an
  offline backlog of long tasks, a batch backlog that saturates the worker,
  and a realtime Poisson stream of short tasks. Printed per tier: realtime
  P50/P99 latency (publish -> done), batch throughput, offline progress and
  the longest wait, and the ratios celery-prio / native;
* dispatch overhead: the no-op drain rate of a celery-prio worker vs a default
  Celery worker, and the publish rate through the router vs plain apply_async.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import redis

from ..brokers import adapter_for
from ..settings import load_settings
from ..tiers import Tier
from .benchapp import NATIVE_PRIORITY, make_app
from .workers import WorkerProcess, free_port

BROKER_URLS = {"redis": "redis://127.0.0.1:6379/14", "amqp": "amqp://guest:guest@127.0.0.1:5672//"}
RECORD_URL = "redis://127.0.0.1:6379/14"
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

    @property
    def batch_backlog(self) -> int:
        # Enough batch work to keep every slot busy for the whole run.
        return math.ceil(1.5 * self.concurrency * self.duration / self.batch_seconds)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _broker_kind(url: str) -> str:
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
        self.kind = _broker_kind(broker)
        self.records = redis.Redis.from_url(RECORD_URL)
        self.logdir, self.concurrency = logdir, concurrency
        self.worker: WorkerProcess | None = None
        self.started = 0  # workers started so far (each gets its own node name and log)

    def start_worker(self) -> None:
        env = {
            "BENCH_MODE": self.mode,
            "BENCH_BROKER": self.broker,
            "BENCH_PREFIX": self.prefix,
            "BENCH_RECORD": RECORD_URL,
            "BENCH_OPTIONS": json.dumps(self.app_options),
        }
        self.started += 1
        n = self.started
        self.worker = WorkerProcess(
            "celery_prio.tools.benchapp",
            log_path=self.logdir / f"{self.prefix}-{self.mode}-{n}.log",
            concurrency=self.concurrency,
            hostname=f"{self.mode}{n}-{self.prefix}@%h",  # distinct node names: a second worker is not the first
            env=env,
        )
        self.worker.wait_ready()

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
        if self.mode == "prio" and self.tier_on == "decorator":
            self.app.tasks[f"bench.{kind}_{tier}"].apply_async(args)
        elif self.mode == "prio":
            task.apply_async(args, tier=tier)
        elif self.mode.startswith("native"):
            task.apply_async(args, priority=NATIVE_PRIORITY[self.kind][tier])
        else:
            task.apply_async(args)
        return sent

    def read(self) -> list[tuple[str, float, float, float]]:
        rows = self.records.lrange(f"{self.prefix}:records", 0, -1)
        out = []
        for row in rows:
            tier, sent, start, end = row.decode().split()
            out.append((tier, float(sent), float(start), float(end)))
        return out

    def close(self) -> None:
        if self.worker:
            self.worker.kill()
        adapter = adapter_for(self.app)
        try:
            names = [f"{self.prefix}.{t}" for t in ("realtime", "batch", "offline", "fifo", "dead")]
            names += [f"{n}.{suffix}" for n in names[:3] for suffix in ("promoted", "dlx")]
            adapter.delete_queues(names)
            # Sub-queues, their registry and the markers of sliced tasks' continuations.
            if self.kind == "redis":
                for key in adapter.client.scan_iter(f"{self.prefix}.*"):
                    adapter.client.delete(key)
            else:
                from ..brokers.amqp.management import management_client
                from ..settings import settings_for

                listing = management_client(self.app, settings_for(self.app)).list_queues(rf"^{self.prefix}\.")
                adapter.delete_queues([name for name, _ in listing or []])
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
        run.start_worker()
        if not cold:
            run.warm_up()
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
        cutoff, records = await_realtime(run, sent_rt, w.grace)
    finally:
        run.close()
    return summarize(records, t0, t_end, cutoff, sent_rt, offline_sent, w)


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


def run_drain(
    mode: str, broker: str, n: int, concurrency: int, logdir: Path, seconds: float = 0.0, **app_options: Any
) -> float:
    """Tasks per second a worker drains from a pre-filled queue of tasks of ``seconds`` each (no-op by default)."""
    run = Run(mode, broker, logdir, concurrency, **app_options)
    try:
        for _ in range(n):
            run.publish("batch", seconds)
        run.start_worker()
        deadline = time.time() + 120
        while run.records.llen(f"{run.prefix}:records") < n and time.time() < deadline:
            time.sleep(0.05)
        records = run.read()
    finally:
        run.close()
    starts = sorted(r[2] for r in records)
    if len(starts) < n:
        raise RuntimeError(f"{mode} worker drained only {len(starts)} of {n} tasks")
    # From the 10th start on: worker start-up is not dispatch overhead.
    return (len(starts) - 10) / (starts[-1] - starts[9])


def run_publish(mode: str, broker: str, n: int, logdir: Path, **app_options: Any) -> float:
    run = Run(mode, broker, logdir, 1, **app_options)
    try:
        run.publish("batch", 0.0)  # connect and declare outside the timing
        t = time.perf_counter()
        for _ in range(n):
            run.publish("batch", 0.0)
        return n / (time.perf_counter() - t)
    finally:
        run.close()


def bench_aging_pass(out=print, sizes=(1_000, 1_000_000), aged: int = 100) -> dict[int, float]:
    """Cost of one Redis aging pass over an offline backlog of which ``aged`` are due.

    The backlog is filled with small stamped messages (not due) and ``aged``
    real task messages at the oldest end; the pass must not look further.
    """
    from ..brokers.redis.admin import RedisAdapter
    from ..settings import settings_for

    results = {}
    for size in sizes:
        run = Run("prio", BROKER_URLS["redis"], Path(tempfile.gettempdir()), 1)
        try:
            settings = settings_for(run.app)
            adapter = RedisAdapter(run.app)
            queue = settings.queue_name(Tier.OFFLINE)
            run.publish("offline", 0.0)
            template = json.loads(adapter.client.rpop(queue))
            now = time.time()
            # Real-looking messages that waited 1 s: not due, so the pass stops at the first.
            filler = json.dumps({**template, "headers": {**template["headers"], "prio_enqueued_at": now - 1}})
            pipe = adapter.client.pipeline(transaction=False)
            for i in range(size - aged):
                pipe.lpush(queue, filler)
                if i % 10_000 == 9_999:
                    pipe.execute()
            for i in range(aged):  # the oldest end, due long ago
                template["headers"]["id"] = f"aged-{i}"
                template["headers"]["prio_enqueued_at"] = now - 10_000
                pipe.rpush(queue, json.dumps(template))
            pipe.execute()
            for script in (adapter._promote, adapter._stamp, adapter._dead_head):
                adapter.client.script_load(script.script)  # a first call's SCRIPT LOAD is not the pass's cost
            started = time.perf_counter()
            moved = adapter.promote_aged(settings, Tier.OFFLINE, time.time())
            results[size] = time.perf_counter() - started
            if moved != aged:
                raise RuntimeError(f"aging pass moved {moved}, expected {aged}")
            adapter.close()
        finally:
            run.close()
    small, large = results[sizes[0]], results[sizes[-1]]
    out(
        f"aging pass, {aged} due (redis): backlog {sizes[0]:,} -> {small * 1000:.2f} ms; backlog "
        f"{sizes[-1]:,} -> {large * 1000:.2f} ms (target <= 10 ms); ratio {large / small:.2f}"
    )
    return results


def best_of(rounds: int, setups: dict[str, tuple[str, dict[str, Any]]], measure) -> dict[str, float]:
    """Best rate per setup over interleaved rounds: the machine's noise hits every setup alike."""
    rates: dict[str, list[float]] = {name: [] for name in setups}
    names = list(setups)
    for round_ in range(rounds):
        # Rotate the order each round so that no setup always runs in the same slot.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            mode, options = setups[name]
            rates[name].append(measure(mode, **options))
    return {name: max(values) for name, values in rates.items()}


def bench_drain(broker: str, w: Workload, drain_n: int, logdir: Path, out=print) -> dict[str, Any]:
    """Dispatch cost: a pre-filled queue drained by a default Celery worker and by a celery-prio one.

    On RabbitMQ both fetch modes are measured: ``get`` (the default, nothing held) and ``consume`` (pushed).
    """
    both_fetch_modes = _broker_kind(broker) == "amqp"
    drain_setups: dict[str, tuple[str, dict[str, Any]]] = {
        "fifo": ("fifo", {}),
        "prio": ("prio", {}),
        "prio_metrics": ("prio", {"metrics_port": free_port()}),
    }
    if both_fetch_modes:
        drain_setups["prio_consume"] = ("prio", {"fetch": "consume"})
    drain = best_of(2, drain_setups, lambda mode, **o: run_drain(mode, broker, drain_n, w.concurrency, logdir, **o))
    drain_ratio = drain["prio"] / drain["fifo"]
    metrics_ratio = drain["prio_metrics"] / drain["prio"]
    out(
        f"no-op drain ({drain_n} tasks, concurrency {w.concurrency}): default Celery {drain['fifo']:.0f}/s, "
        f"celery-prio {drain['prio']:.0f}/s, ratio {drain_ratio:.2f} (target >= 0.8)"
    )
    if both_fetch_modes:
        out(f"  prio_fetch='consume': {drain['prio_consume']:.0f}/s, ratio {drain['prio_consume'] / drain['fifo']:.2f}")
    out(
        f"  with Prometheus metrics on: {drain['prio_metrics']:.0f}/s, ratio to metrics off {metrics_ratio:.2f} "
        f"(target >= 0.95)"
    )
    short_n = max(drain_n // 3, 200)
    # reserve=0: a reserved slot is idle by design, the figure is about dispatch cost.
    short_setups: dict[str, tuple[str, dict[str, Any]]] = {"fifo": ("fifo", {}), "prio": ("prio", {"reserve": 0})}
    if both_fetch_modes:
        short_setups["prio_consume"] = ("prio", {"reserve": 0, "fetch": "consume"})
    short = best_of(
        2, short_setups, lambda mode, **o: run_drain(mode, broker, short_n, w.concurrency, logdir, seconds=0.005, **o)
    )
    short_ratio = short["prio"] / short["fifo"]
    out(
        f"5 ms drain ({short_n} tasks): default Celery {short['fifo']:.0f}/s, celery-prio {short['prio']:.0f}/s, "
        f"ratio {short_ratio:.2f} (target >= 0.95)"
    )
    results = {
        "drain_per_s": drain,
        "drain_ratio": drain_ratio,
        "drain_5ms_per_s": short,
        "drain_5ms_ratio": short_ratio,
    }
    if both_fetch_modes:
        out(f"  prio_fetch='consume': {short['prio_consume']:.0f}/s, ratio {short['prio_consume'] / short['fifo']:.2f}")
        results["drain_consume_ratio"] = drain["prio_consume"] / drain["fifo"]
        results["drain_5ms_consume_ratio"] = short["prio_consume"] / short["fifo"]
    return results


def bench_broker(broker: str, w: Workload, drain_n: int, publish_n: int, logdir: Path, out=print) -> dict[str, Any]:
    kind = _broker_kind(broker)
    out(
        f"\n== {kind}: mixed workload, {w.duration:.0f} s, concurrency {w.concurrency}, "
        f"realtime {w.rt_rate:.0f}/s x {w.rt_seconds * 1000:.0f} ms, batch {w.batch_seconds * 1000:.0f} ms, "
        f"offline backlog {w.offline_backlog} x {w.offline_seconds:.1f} s"
    )
    # Celery >= 5.6's worker_disable_prefetch (celery #6500's fix) exists for Redis only.
    modes = ("fifo", "native", "native_noprefetch", "prio") if kind == "redis" else ("fifo", "native", "prio")
    mixed = {mode: run_mixed(mode, broker, w, logdir) for mode in modes}
    # The idle-share rule decides how batch and offline split what realtime leaves: 2:1 by default.
    mixed["prio_next_below"] = run_mixed("prio", broker, w, logdir, idle_share="next_below")
    out(
        f"{'setup':<18}{'rt p50 ms':>11}{'rt p99 ms':>11}{'rt done':>10}{'batch/s':>9}"
        f"{'off busy s':>11}{'2nd half':>9}{'off max wait s':>16}"
    )
    for mode, m in mixed.items():
        out(
            f"{mode:<18}{m['realtime']['p50_ms']:>11.0f}{m['realtime']['p99_ms']:>11.0f}"
            f"{m['realtime']['done']:>6}/{m['realtime']['sent']:<3}{m['batch']['per_s']:>9.1f}"
            f"{m['offline']['busy_s']:>11.1f}{m['offline']['busy_late_s']:>9.1f}{m['offline']['longest_wait_s']:>16.1f}"
        )
    native, prio = mixed["native"], mixed["prio"]
    ratios = {
        "realtime_p99_prio_over_native": prio["realtime"]["p99_ms"] / native["realtime"]["p99_ms"],
        "realtime_p99_prio_over_fifo": prio["realtime"]["p99_ms"] / mixed["fifo"]["realtime"]["p99_ms"],
        "realtime_p99_no_prefetch_ms": mixed.get("native_noprefetch", {}).get("realtime", {}).get("p99_ms"),
        "batch_throughput_prio_over_native": prio["batch"]["per_s"] / max(native["batch"]["per_s"], 1e-9),
        "batch_throughput_next_below_over_native": mixed["prio_next_below"]["batch"]["per_s"]
        / max(native["batch"]["per_s"], 1e-9),
        "offline_busy_late_s_prio_vs_native": [prio["offline"]["busy_late_s"], native["offline"]["busy_late_s"]],
    }
    if "native_noprefetch" in mixed:
        out(
            f"Celery 5.6+ worker_disable_prefetch with native priority: realtime P99 "
            f"{mixed['native_noprefetch']['realtime']['p99_ms']:.0f} ms against celery-prio's "
            f"{prio['realtime']['p99_ms']:.0f} ms"
        )
    out(
        f"ratios: realtime P99 prio/native = {ratios['realtime_p99_prio_over_native']:.2f} (target <= 0.4), "
        f"prio/fifo = {ratios['realtime_p99_prio_over_fifo']:.3f}; "
        f"batch throughput prio/native = {ratios['batch_throughput_prio_over_native']:.2f} "
        f"(idle_share='next_below': {ratios['batch_throughput_next_below_over_native']:.2f}; target >= 0.8); "
        f"offline slot-seconds in the second half: prio {prio['offline']['busy_late_s']:.1f} vs native "
        f"{native['offline']['busy_late_s']:.1f}"
    )

    # The idle-share rule: realtime quiet, batch and offline backlogged.
    quiet = replace(w, rt_rate=0.0)
    idle = {rule: run_mixed("prio", broker, quiet, logdir, idle_share=rule) for rule in ("proportional", "next_below")}
    ratio = {rule: m["offline"]["batch_busy_s"] / max(m["offline"]["busy_s"], 1e-9) for rule, m in idle.items()}
    out(
        f"realtime quiet, batch:offline slot time: {ratio['proportional']:.2f}:1 with idle_share='proportional' "
        f"(default, target 2:1 +/- 15 %), {ratio['next_below']:.2f}:1 with 'next_below' (configured 10:1)"
    )

    # Aging: offline work arrives faster than offline's own share drains it,
    # so without aging its queue (and wait) keeps growing; with aging each
    # task moves to batch after the threshold.
    aging_w = replace(w, offline_backlog=0, offline_rate=AGING_OFFLINE_RATE, offline_seconds=1.0)
    aging = {
        label: run_mixed("prio", broker, aging_w, logdir, aging=setting)
        for label, setting in (("off", AGING_OFF), ("on", AGING_ON))
    }
    out(
        f"aging ({AGING_OFFLINE_RATE}/s offline tasks of 1 s during the run): offline max wait "
        f"{aging['off']['offline']['longest_wait_s']:.1f} s without aging, "
        f"{aging['on']['offline']['longest_wait_s']:.1f} s with a {AGING_ON['offline']} s threshold "
        f"(p50 {aging['off']['offline']['p50_wait_s']:.1f} s vs {aging['on']['offline']['p50_wait_s']:.1f} s)"
    )

    drain_figures = bench_drain(broker, w, drain_n, logdir, out)
    setups: dict[str, tuple[str, dict[str, Any]]] = {
        "plain": ("fifo", {}),
        "router": ("prio", {"max_length": NO_CAPS}),
        "admission": ("prio", {}),
    }
    if kind == "amqp":  # RabbitMQ only reports a full reject-publish queue through confirms
        setups["plain_confirms"] = ("fifo", {"confirm": True})
    publish = best_of(3, setups, lambda mode, **o: run_publish(mode, broker, publish_n, logdir, **o))
    publish_ratio = publish["router"] / publish["plain"]
    admission_ratio = publish["admission"] / publish["plain"]
    out(
        f"publish ({publish_n} tasks): plain apply_async {publish['plain']:.0f}/s; through the router "
        f"{publish['router']:.0f}/s, ratio {publish_ratio:.2f} (target >= 0.9); with admission control "
        f"{publish['admission']:.0f}/s, ratio {admission_ratio:.2f} (target >= 0.8)"
    )
    if kind == "amqp":
        out(
            f"  plain apply_async with publisher confirms {publish['plain_confirms']:.0f}/s; admission / that "
            f"= {publish['admission'] / publish['plain_confirms']:.2f} (the confirm round trip is the cost)"
        )
    return {
        "mixed": mixed,
        "ratios": ratios,
        "idle_share_batch_to_offline": ratio,
        **drain_figures,
        "publish_per_s": publish,
        "publish_ratio": publish_ratio,
        "admission_ratio": admission_ratio,
    }


@dataclass
class SliceWorkload:
    """Issue 12's mix: long batch jobs of short slices, an offline backlog, a light realtime stream."""

    duration: float = 20.0
    concurrency: int = 1
    rt_rate: float = 5.0
    rt_seconds: float = 0.02
    batch_seconds: float = 2.0
    offline_seconds: float = 4.0
    element_seconds: float = 0.1
    offline_backlog: int = 5
    grace: float = 5.0
    seed: int = 11

    @property
    def batch_backlog(self) -> int:
        return math.ceil(1.5 * self.concurrency * self.duration / self.batch_seconds)


def run_sliced(
    mode: str,
    broker: str,
    w: SliceWorkload,
    logdir: Path,
    cold: bool = False,
    tier_on: str = "call",
    **app_options: Any,
) -> dict[str, Any]:
    """Realtime latency and batch/offline items per second on a worker busy with long sliced tasks."""
    run = Run(mode, broker, logdir, w.concurrency, tier_on=tier_on, **app_options)
    try:
        run.start_worker()
        if not cold:
            run.warm_up()
        for _ in range(w.offline_backlog):
            run.publish("offline", w.offline_seconds, elements=round(w.offline_seconds / w.element_seconds))
        for _ in range(w.batch_backlog):
            run.publish("batch", w.batch_seconds, elements=round(w.batch_seconds / w.element_seconds))
        t0 = time.time()
        t_end = t0 + w.duration
        streams = {"realtime": (w.rt_rate, lambda: run.publish("realtime", w.rt_seconds))}
        sent_rt = poisson_streams(streams, t0, t_end, random.Random(w.seed))["realtime"]
        cutoff, records = await_realtime(run, sent_rt, w.grace)
    finally:
        run.close()
    rt = [end - sent for tier, sent, _, end in records if tier == "realtime"]
    rt += [cutoff - t0] * max(0, sent_rt - len(rt))
    items = {
        tier: sum(1 for r in records if r[0] == f"{tier}-item" and t0 <= r[3] <= t_end) for tier in ("batch", "offline")
    }
    return {
        "realtime": {"sent": sent_rt, "p50_ms": percentile(rt, 50) * 1000, "p99_ms": percentile(rt, 99) * 1000},
        "batch_items_per_s": items["batch"] / w.duration,
        "offline_items_per_s": items["offline"] / w.duration,
    }


def bench_slices(broker: str, w: SliceWorkload, logdir: Path, out=print) -> dict[str, Any]:
    kind = _broker_kind(broker)
    sliced = {"slice": {"batch": w.element_seconds, "offline": w.element_seconds}}
    unsliced = {"slice": {"batch": None, "offline": None}}
    one = {
        "native": run_sliced("native", broker, w, logdir),
        "prio_sliced": run_sliced("prio", broker, w, logdir, reserve=0, **sliced),
        "prio_unsliced": run_sliced("prio", broker, w, logdir, reserve=0, **unsliced),
        # The idle-share rule decides how batch and offline split what realtime leaves (2:1 by default).
        "prio_sliced_next_below": run_sliced("prio", broker, w, logdir, reserve=0, idle_share="next_below", **sliced),
    }
    w4 = replace(w, concurrency=4)
    four = {
        "prio_reserve1_unsliced": run_sliced("prio", broker, w4, logdir, reserve=1, **unsliced),
        "prio_reserve0_sliced": run_sliced("prio", broker, w4, logdir, reserve=0, **sliced),
    }
    out(
        f"\n== {kind}: GPU time slices, {w.duration:.0f} s: batch {w.batch_seconds:.0f} s tasks and an offline "
        f"backlog of {w.offline_seconds:.0f} s tasks, both in {w.element_seconds * 1000:.0f} ms slices; "
        f"realtime {w.rt_rate:.0f}/s x {w.rt_seconds * 1000:.0f} ms"
    )
    out(f"{'setup':<42}{'rt p50 ms':>11}{'rt p99 ms':>11}{'batch items/s':>15}{'offline items/s':>17}")
    for label, rows in (("concurrency 1", one), ("concurrency 4", four)):
        for name, m in rows.items():
            out(
                f"{label + ', ' + name:<42}{m['realtime']['p50_ms']:>11.0f}{m['realtime']['p99_ms']:>11.0f}"
                f"{m['batch_items_per_s']:>15.1f}{m['offline_items_per_s']:>17.1f}"
            )
    native, prio = one["native"], one["prio_sliced"]
    ratios = {
        "c1_batch_items_prio_over_native": prio["batch_items_per_s"] / max(native["batch_items_per_s"], 1e-9),
        "c1_batch_items_next_below_over_native": one["prio_sliced_next_below"]["batch_items_per_s"]
        / max(native["batch_items_per_s"], 1e-9),
        "c1_rt_p99_ms": prio["realtime"]["p99_ms"],
        "c1_rt_p99_native_ms": native["realtime"]["p99_ms"],
        "c4_rt_p99_sliced_over_reserve": four["prio_reserve0_sliced"]["realtime"]["p99_ms"]
        / four["prio_reserve1_unsliced"]["realtime"]["p99_ms"],
        "c4_low_items_sliced_over_reserve": (
            four["prio_reserve0_sliced"]["batch_items_per_s"] + four["prio_reserve0_sliced"]["offline_items_per_s"]
        )
        / max(
            four["prio_reserve1_unsliced"]["batch_items_per_s"] + four["prio_reserve1_unsliced"]["offline_items_per_s"],
            1e-9,
        ),
    }
    out(
        f"concurrency 1: realtime P99 {prio['realtime']['p99_ms']:.0f} ms sliced (target <= 200) vs native priority "
        f"{native['realtime']['p99_ms']:.0f} ms; batch items/s prio/native = "
        f"{ratios['c1_batch_items_prio_over_native']:.2f} (target >= 0.85; with idle_share='next_below' "
        f"{ratios['c1_batch_items_next_below_over_native']:.2f})"
    )
    out(
        f"concurrency 4: reserve 0 + slices vs reserve 1 unsliced: realtime P99 ratio "
        f"{ratios['c4_rt_p99_sliced_over_reserve']:.2f} (target <= 1), batch+offline items/s ratio "
        f"{ratios['c4_low_items_sliced_over_reserve']:.2f} (target > 1)"
    )
    return {"concurrency_1": one, "concurrency_4": four, "ratios": ratios}


def management_api_answers(port: int = 15672) -> bool:
    """Whether RabbitMQ's management API answers on this machine (the stock image runs without it)."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


#: The slice lengths ``prio_slice`` defaulted to before they were derived from ``prio_realtime_target``.
PREVIOUS_SLICES = {"batch": 0.2, "offline": 0.5}
PREVIOUS_SLICES_ROW = "prio per call, prio_slice 0.2/0.5 (before)"


def default_setups(kind: str) -> dict[str, dict[str, Any]]:
    """celery-prio as a new user runs it: ``install(app)`` defaults (RabbitMQ: with and without its management
    API), tiers per call and on the decorator. Each maps to ``run_mixed``/``run_sliced`` keyword arguments."""
    setups: dict[str, dict[str, Any]] = {}
    forms = {"": {}}
    if kind == "amqp":
        forms = {"no mgmt, ": {"management_url": f"http://127.0.0.1:{free_port()}"}}
        if management_api_answers():
            forms = {"mgmt, ": {}, **forms}
    for form, options in forms.items():
        for tier_on in ("call", "decorator"):
            setups[f"prio {form}tier per {tier_on}"] = {"tier_on": tier_on, **options}
    return setups


def bench_defaults(broker: str, mixed: Workload, sliced: SliceWorkload, logdir: Path, out=print) -> dict[str, Any]:
    """What a new user gets: defaults only, cold (no warm-up), against broker-native priority, side by side."""
    kind = _broker_kind(broker)
    setups = default_setups(kind)
    if kind == "amqp" and not management_api_answers():
        out("  (RabbitMQ's management API does not answer here: only the rows without it are measured)")
    results: dict[str, Any] = {"mixed": {}, "slices": {}}
    out(
        f"\n== {kind}: as a new user runs it (install(app) defaults, cold, no prio_slice): overload mix "
        f"(concurrency {mixed.concurrency}, realtime {mixed.rt_rate:.0f}/s x {mixed.rt_seconds * 1000:.0f} ms, "
        f"batch backlog, offline backlog) and GPU slices (concurrency {sliced.concurrency}, "
        f"{sliced.element_seconds * 1000:.0f} ms elements, realtime {sliced.rt_rate:.0f}/s)"
    )
    results["mixed"]["native"] = run_mixed("native", broker, mixed, logdir, cold=True)
    results["slices"]["native"] = run_sliced("native", broker, sliced, logdir, cold=True)
    for name, options in setups.items():
        results["mixed"][name] = run_mixed("prio", broker, mixed, logdir, cold=True, **options)
        results["slices"][name] = run_sliced("prio", broker, sliced, logdir, cold=True, **options)
    # What the derived slice length costs batch and offline: the same -c 1 run with the lengths it replaced.
    first = next(iter(setups.values()))
    results["slices"][PREVIOUS_SLICES_ROW] = run_sliced(
        "prio", broker, sliced, logdir, cold=True, slice=PREVIOUS_SLICES, **first
    )
    out(
        f"{'setup':<38}{'mix rt p99 ms':>14}{'vs native':>10}{'batch/s':>9}{'c1 rt p99 ms':>13}{'vs native':>10}"
        f"{'batch it/s':>11}{'off it/s':>9}"
    )
    ratios = {}
    for name in results["slices"]:
        m, c1 = results["mixed"].get(name), results["slices"][name]
        c1_ratio = c1["realtime"]["p99_ms"] / results["slices"]["native"]["realtime"]["p99_ms"]
        ratios[name] = {"c1_rt_p99_over_native": c1_ratio}
        mixed_cols = f"{'':>14}{'':>10}{'':>9}"
        if m is not None:
            mix_ratio = m["realtime"]["p99_ms"] / results["mixed"]["native"]["realtime"]["p99_ms"]
            ratios[name]["mixed_rt_p99_over_native"] = mix_ratio
            mixed_cols = f"{m['realtime']['p99_ms']:>14.0f}{mix_ratio:>10.2f}{m['batch']['per_s']:>9.1f}"
        out(
            f"{name:<38}{mixed_cols}{c1['realtime']['p99_ms']:>13.0f}{c1_ratio:>10.2f}"
            f"{c1['batch_items_per_s']:>11.1f}{c1['offline_items_per_s']:>9.1f}"
        )
    out("targets: overload-mix realtime P99 well under native priority's; -c 1 sliced realtime P99 <= 200 ms")
    results["ratios"] = ratios
    return results


def run_tenants(broker: str, duration: float, logdir: Path, subqueues: bool, flood: int = 20_000) -> dict[str, Any]:
    """Batch tier: tenant A floods it at once, tenant B trickles 2/s. B's queue wait, with or without sub-queues."""
    from ..producer.bulk import bulk

    run = Run("prio", broker, logdir, 4, max_length={"batch": None})
    try:
        sub = {"subqueue": "tenant-a"} if subqueues else {}
        bulk(run.task, (("tenant-a", 0.0, 0.05) for _ in range(flood)), tier="batch", **sub)
        run.start_worker()
        t0 = time.time()
        sent = []

        def trickle() -> None:
            stamp = time.time()
            run.task.apply_async(
                ("tenant-b", stamp, 0.05), tier="batch", **({"subqueue": "tenant-b"} if subqueues else {})
            )
            sent.append(stamp)

        poisson_streams({"b": (2.0, trickle)}, t0, t0 + duration, random.Random(3))
        time.sleep(1.0)
        cutoff, records = time.time(), run.read()
    finally:
        run.close()
    started = {s: start for tier, s, start, _ in records if tier == "tenant-b"}
    waits = [started[s] - s if s in started else cutoff - s for s in sent]  # not started: waited until the cut-off
    return {
        "b_sent": len(sent),
        "b_started": len(started),
        "b_p50_wait_s": percentile(waits, 50),
        "b_p99_wait_s": percentile(waits, 99),
    }


def bench_subqueues(broker: str, duration: float, logdir: Path, out=print) -> dict[str, Any]:
    kind = _broker_kind(broker)
    shared = run_tenants(broker, duration, logdir, subqueues=False)
    split = run_tenants(broker, duration, logdir, subqueues=True)
    out(
        f"\n== {kind}: tenants in the batch tier, {duration:.0f} s: A publishes 20,000 x 50 ms at once, B 2/s "
        f"(concurrency 4): B's queue wait P50/P99 {shared['b_p50_wait_s']:.2f}/{shared['b_p99_wait_s']:.2f} s in one "
        f"shared queue ({shared['b_started']}/{shared['b_sent']} started), {split['b_p50_wait_s']:.2f}/"
        f"{split['b_p99_wait_s']:.2f} s with a sub-queue per tenant ({split['b_started']}/{split['b_sent']} "
        f"started; target P99 <= 1 s)"
    )
    return {"shared_queue": shared, "subqueues": split}


def run_sjf(broker: str, duration: float, logdir: Path, sjf: bool) -> dict[str, Any]:
    """Realtime only at ~80 % load: 20 ms tasks (40/s) and 500 ms tasks (4.8/s) on 4 slots."""
    run = Run("prio", broker, logdir, 4, sjf=sjf, reserve=0)
    try:
        run.start_worker()
        short, long = run.app.tasks["bench.work"], run.app.tasks["bench.work_long"]
        for task in (short, long):  # the sub-queues exist and their run times are known before the clock starts
            task.apply_async(("warm", time.time(), 0.0), tier="realtime")
        time.sleep(2.5)
        t0 = time.time()
        streams = {
            "short": (40.0, lambda: short.apply_async(("short", time.time(), 0.02), tier="realtime")),
            "long": (4.8, lambda: long.apply_async(("long", time.time(), 0.5), tier="realtime")),
        }
        poisson_streams(streams, t0, t0 + duration, random.Random(5))
        time.sleep(3.0)
        records = [r for r in run.read() if r[0] in ("short", "long") and r[1] >= t0]
    finally:
        run.close()
    waits = {kind: [start - sent for k, sent, start, _ in records if k == kind] for kind in ("short", "long")}
    return {
        "short_mean_wait_s": sum(waits["short"]) / max(len(waits["short"]), 1),
        "short_p99_wait_s": percentile(waits["short"], 99),
        "long_p99_wait_s": percentile(waits["long"], 99),
        "long_max_wait_s": max(waits["long"], default=0.0),
        "done": {kind: len(v) for kind, v in waits.items()},
    }


def bench_sjf(broker: str, duration: float, logdir: Path, out=print) -> dict[str, Any]:
    kind = _broker_kind(broker)
    fifo = run_sjf(broker, duration, logdir, sjf=False)
    sjf = run_sjf(broker, duration, logdir, sjf=True)
    ratio = sjf["short_mean_wait_s"] / max(fifo["short_mean_wait_s"], 1e-9)
    out(
        f"\n== {kind}: realtime at ~80 % load, 20 ms and 500 ms tasks, {duration:.0f} s, concurrency 4: short tasks' "
        f"mean wait {fifo['short_mean_wait_s'] * 1000:.0f} ms FIFO in the tier, "
        f"{sjf['short_mean_wait_s'] * 1000:.0f} ms shortest-first, ratio {ratio:.2f} (target <= 0.5); "
        f"long tasks' P99/max wait "
        f"{fifo['long_p99_wait_s']:.2f}/{fifo['long_max_wait_s']:.2f} s FIFO, {sjf['long_p99_wait_s']:.2f}/"
        f"{sjf['long_max_wait_s']:.2f} s shortest-first (bound: FIFO + prio_sjf_max_wait 1.0 s)"
    )
    return {"fifo_in_tier": fifo, "sjf": sjf, "short_wait_ratio": ratio}


def run_dependency_wait(mode: str, broker: str, backlog: int, seconds: float, logdir: Path) -> dict[str, Any]:
    """A realtime caller needs one offline task's output, published behind ``backlog`` offline tasks.

    ``native``: plain Celery with broker-native priorities (the dependency has offline's priority);
    ``prio``: celery-prio, the caller just waits; ``boost``: celery-prio, the caller boosts what it
    waits on to realtime first (what ``celery_prio.wait`` does). Returns the caller's wait.
    """
    from ..boost import boost
    from ..producer.bulk import bulk

    run = Run("native" if mode == "native" else "prio", broker, logdir, 4)
    try:
        run.start_worker()
        run.warm_up()
        if mode == "native":
            for _ in range(backlog):
                run.publish("offline", seconds, label="backlog")
        else:
            bulk(run.task, (("backlog", 0.0, seconds) for _ in range(backlog)), tier="offline")
        time.sleep(0.5)  # the worker is busy with the backlog before the dependency arrives
        sent = time.time()
        args = ("dependency", sent, seconds)
        if mode == "native":
            run.task.apply_async(args, priority=NATIVE_PRIORITY[run.kind]["offline"])
        else:
            dependency = run.task.apply_async(args, tier="offline")
            if mode == "boost":
                outcome = boost(dependency, "realtime")
                if not outcome.lifted:
                    raise RuntimeError(f"the boost did not lift the dependency: {outcome}")
        deadline = sent + 600
        while time.time() < deadline:
            done = [end for label, s, _, end in run.read() if label == "dependency" and s == sent]
            if done:
                return {"wait_s": done[0] - sent}
            time.sleep(0.02)
        raise RuntimeError(f"{mode}: the dependency did not finish within 600 s")
    finally:
        run.close()


def bench_inherit(broker: str, backlog: int, seconds: float, logdir: Path, out=print) -> dict[str, Any]:
    kind = _broker_kind(broker)
    waits = {mode: run_dependency_wait(mode, broker, backlog, seconds, logdir)["wait_s"] for mode in MODES_INHERIT}
    out(
        f"\n== {kind}: a realtime caller waits on one offline task behind {backlog:,} offline tasks of "
        f"{seconds * 1000:.0f} ms (concurrency 4): native priority {waits['native']:.2f} s, celery-prio without "
        f"inheritance {waits['prio']:.2f} s, with boost/wait {waits['boost']:.3f} s "
        f"(ratio to native {waits['boost'] / waits['native']:.3f}, "
        f"to no inheritance {waits['boost'] / waits['prio']:.3f})"
    )
    return waits


MODES_INHERIT = ("native", "prio", "boost")


def bench_boost_cost(out=print, size: int = 1_000_000) -> dict[str, float]:
    """Cost of one Redis boost in an offline backlog of ``size`` real-size messages: the target at the
    newest end (what a caller usually waits on) and at the oldest end (the scan reads everything)."""
    from ..boost import boost

    run = Run("prio", BROKER_URLS["redis"], Path(tempfile.gettempdir()), 1)
    results = {}
    try:
        adapter = adapter_for(run.app)
        queue = f"{run.prefix}.offline"
        run.publish("offline", 0.0)
        template = json.loads(adapter.client.rpop(queue))
        filler = json.dumps(template)
        pipe = adapter.client.pipeline(transaction=False)
        for i in range(size - 2):
            pipe.lpush(queue, filler)
            if i % 10_000 == 9_999:
                pipe.execute()
        for where, push in (("oldest", pipe.rpush), ("newest", pipe.lpush)):
            template["headers"]["id"] = template["properties"]["correlation_id"] = f"target-{where}"
            push(queue, json.dumps(template))
        pipe.execute()
        for where in ("newest", "oldest"):
            started = time.perf_counter()
            outcome = boost(f"target-{where}", "realtime", app=run.app)
            results[where] = time.perf_counter() - started
            if not outcome.lifted:
                raise RuntimeError(f"boost of the {where} message did not lift it: {outcome}")
        adapter.close()
    finally:
        run.close()
    out(
        f"boost (redis), backlog {size:,}: newest message {results['newest'] * 1000:.1f} ms, oldest "
        f"{results['oldest'] * 1000:.0f} ms (the whole list read, in looks of 10,000 elements)"
    )
    return results


SEED_DAY = 5_000_000  # batch items a day on the seed's platform


def bench_bulk(broker: str, plain_n: int, bulk_n: int, logdir: Path, out=print) -> dict[str, Any]:
    """Enqueue rate: apply_async in a loop vs celery_prio.bulk, one producer thread, same app; producer memory."""
    import tracemalloc

    from ..producer.bulk import bulk

    kind = _broker_kind(broker)
    run = Run("prio", broker, logdir, 1, max_length={"batch": None})
    try:
        run.publish("batch", 0.0)  # connect and declare outside the timing
        started = time.perf_counter()
        for _ in range(plain_n):
            run.task.apply_async(("batch", 0.0, 0.0), tier="batch")
        plain = plain_n / (time.perf_counter() - started)
        started = time.perf_counter()
        ids = bulk(run.task, (("batch", 0.0, 0.0) for _ in range(bulk_n)), tier="batch", chunk=1000)
        rate = len(ids) / (time.perf_counter() - started)
        # Memory on its own runs: tracemalloc slows Python several times over.
        peaks = {}
        for n in (bulk_n // 20, bulk_n // 5):
            tracemalloc.start()
            bulk(run.task, (("batch", 0.0, 0.0) for _ in range(n)), tier="batch", chunk=1000)
            peaks[n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        depth = adapter_for(run.app)
        try:
            enqueued = depth.depth(f"{run.prefix}.batch")
        finally:
            depth.close()
    finally:
        run.close()
    small, large = sorted(peaks)
    expected = 1 + plain_n + bulk_n + small + large
    out(
        f"bulk publish ({kind}): apply_async loop {plain:.0f}/s ({plain_n:,} tasks); bulk {rate:.0f}/s "
        f"({bulk_n:,} tasks, chunks of 1000), ratio {rate / plain:.1f} (target >= 10"
        + (", and >= 20,000/s on Redis)" if kind == "redis" else ")")
    )
    out(
        f"  producer peak memory (tracemalloc) {peaks[small] / 2**20:.1f} MiB for {small:,} items, "
        f"{peaks[large] / 2**20:.1f} MiB for {large:,} (flat: a chunk at a time); the seed's "
        f"{SEED_DAY:,}-item day enqueues in {SEED_DAY / rate / 60:.1f} min "
        f"(apply_async: {SEED_DAY / plain / 60:.0f} min)"
    )
    if enqueued != expected:
        raise RuntimeError(f"bulk bench: {enqueued} messages in the queue, expected {expected}")
    return {
        "plain_per_s": plain,
        "bulk_per_s": rate,
        "ratio": rate / plain,
        "peak_bytes": peaks,
        "seed_day_minutes": SEED_DAY / rate / 60,
    }


def run_recovery(mode: str, broker: str, logdir: Path, limit: float, **app_options: Any) -> dict[str, float | None]:
    """Per tier, seconds from SIGKILL of a worker running an ``acks_late`` task to its start on the worker
    started in its place (None: not within ``limit``). Plain Celery has one queue: its three tasks stand
    for the tiers."""
    run = Run(mode, broker, logdir, 3, **app_options)
    try:
        run.start_worker()
        doomed = run.worker
        late = run.app.tasks["bench.work_late"]
        for tier in ("realtime", "batch", "offline"):
            late.apply_async((tier, 3600.0), **({"tier": tier} if mode == "prio" else {}))
        key = f"{run.prefix}:starts"

        def starts() -> list[tuple[str, float, str]]:
            rows = (row.decode().split() for row in run.records.lrange(key, 0, -1))
            return [(label, float(at), pid) for label, at, pid in rows]

        deadline = time.time() + 30
        while len(starts()) < 3 and time.time() < deadline:
            time.sleep(0.05)
        if len(starts()) < 3:
            raise RuntimeError(f"{mode}: the three tasks did not all start on the first worker")
        killed = time.time()
        doomed.kill()
        # Its replacement starts right away (a supervisor's restart): plain Celery's kombu restores
        # expired messages on its first look (ten seconds in), then every hundredth second only.
        run.start_worker()
        back: dict[str, float | None] = {tier: None for tier in ("realtime", "batch", "offline")}
        while time.time() < killed + limit and None in back.values():
            for label, at, _ in starts()[3:]:
                if back[label] is None:
                    back[label] = at - killed
            time.sleep(0.05)
        return back
    finally:
        run.close()
        run.records.delete(f"{run.prefix}:starts")


def bench_recovery(broker: str, logdir: Path, limit: float = 75.0, out=print) -> dict[str, Any]:
    """A worker SIGKILLed with acks_late tasks in flight: how soon they run again, plain Celery vs celery-prio."""
    kind = _broker_kind(broker)
    setups = {"plain Celery": ("fifo", {})}
    if kind == "redis":  # RabbitMQ returns a dead connection's messages at once, either way
        # kombu restores a gone worker's messages once they are visibility_timeout old, in a sweep
        # every unacked_restore_interval x unacked_restore_throttle s (10 x 10): tuned down, as far as
        # plain Celery goes (and then any task running longer than 5 s is run twice on a live worker).
        setups["plain Celery, visibility_timeout 5 s"] = ("fifo", {"transport_options": {"visibility_timeout": 5}})
        fastest = {"visibility_timeout": 5, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        setups["plain Celery, visibility_timeout 5 s, sweep every 1 s"] = ("fifo", {"transport_options": fastest})
    bounds = "/".join(f"{v:g}" for v in load_settings({}).redeliver_after.values())
    prio_name = f"celery-prio (prio_redeliver_after {bounds} s)" if kind == "redis" else "celery-prio"
    setups[prio_name] = ("prio", {})
    results = {name: run_recovery(mode, broker, logdir, limit, **options) for name, (mode, options) in setups.items()}
    show = lambda v: f"{v:.1f} s" if v is not None else f"not within {limit:.0f} s"  # noqa: E731
    out(f"\n== {kind}: a worker SIGKILLed with an acks_late task per tier in flight, another started at once:")
    for name, back in results.items():
        out(f"  {name}: back after " + " / ".join(f"{tier} {show(v)}" for tier, v in back.items()))
    if kind == "redis":
        plain = results["plain Celery, visibility_timeout 5 s, sweep every 1 s"]["realtime"]
        prio = results[prio_name]["realtime"]
        if plain and prio:
            out(
                f"  realtime back: celery-prio / plain Celery tuned to 5 s = {prio / plain:.2f} (and plain Celery "
                "then runs any task longer than 5 s twice; celery-prio never re-runs a live worker's task)"
            )
    return results


def bench_chaos(logdir: Path, duration: float = 60.0, out=print) -> dict[str, Any]:
    """Workers SIGKILLed and restarted in place, and the broker restarted, under a mixed load, with the
    default bounds (``celery_prio.tools.chaos``; Redis: the run restarts a private redis-server)."""
    from .chaos import run_chaos

    out(f"\n== redis: chaos for {duration:.0f} s (3 workers, default prio_redeliver_after):")
    defaults = {"redeliver_after": {t.label: v for t, v in load_settings({}).redeliver_after.items()}}
    result = run_chaos(logdir / "chaos", duration=duration, settings=defaults, out=out)
    out("  every accepted task completed, none ran twice unexplained, nothing left" if result.ok else "  FAILED")
    return {**asdict(result), "accepted": dict(result.accepted), "ok": result.ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="celery-prio bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--broker",
        action="append",
        help="redis, amqp or a broker URL; repeat for several (default: both local brokers)",
    )
    parser.add_argument("--duration", type=float, default=Workload.duration, help="seconds of realtime stream")
    parser.add_argument("--concurrency", type=int, default=Workload.concurrency)
    parser.add_argument("--rt-rate", type=float, default=Workload.rt_rate, help="realtime requests per second")
    parser.add_argument("--drain-tasks", type=int, default=3000)
    parser.add_argument("--publish-tasks", type=int, default=2000)
    parser.add_argument("--bulk-tasks", type=int, default=200_000, help="tasks for the bulk publish figure")
    parser.add_argument("--bulk-plain-tasks", type=int, default=10_000, help="apply_async loop size it is compared to")
    parser.add_argument(
        "--only",
        choices=("defaults", "mixed", "drain", "bulk", "slices", "subqueues", "sjf", "inherit", "recovery", "chaos"),
        help="run one part: what a new user gets (defaults, cold, tiers per call and on the decorator), the "
        "mixed workload/drain/publish, the drains alone, bulk publish, GPU time slices, sub-queues, SJF, "
        "priority inheritance, recovery after a worker dies, or chaos (kills and a broker restart; not in a full run)",
    )
    parser.add_argument("--inherit-backlog", type=int, default=2000, help="offline tasks ahead of the dependency")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    w = Workload(duration=args.duration, concurrency=args.concurrency, rt_rate=args.rt_rate)
    brokers = [BROKER_URLS.get(b, b) for b in (args.broker or ["redis", "amqp"])]
    results = {}
    with tempfile.TemporaryDirectory(prefix="celery-prio-bench-") as tmp:
        for broker in brokers:
            kind = _broker_kind(broker)
            results[kind] = {}
            if args.only in (None, "defaults"):
                overload = replace(w, rt_rate=DEFAULTS_RT_RATE)
                results[kind]["defaults"] = bench_defaults(
                    broker, overload, SliceWorkload(duration=args.duration), Path(tmp)
                )
            if args.only in (None, "mixed"):
                results[kind].update(bench_broker(broker, w, args.drain_tasks, args.publish_tasks, Path(tmp)))
                if kind == "redis":
                    results["redis"]["aging_pass_s"] = bench_aging_pass()
            if args.only == "drain":
                results[kind]["drain"] = bench_drain(broker, w, args.drain_tasks, Path(tmp))
            if args.only in (None, "bulk"):
                results[kind]["bulk"] = bench_bulk(broker, args.bulk_plain_tasks, args.bulk_tasks, Path(tmp))
            if args.only in (None, "subqueues"):
                results[kind]["subqueues"] = bench_subqueues(broker, args.duration, Path(tmp))
            if args.only in (None, "sjf"):
                results[kind]["sjf"] = bench_sjf(broker, args.duration, Path(tmp))
            if args.only in (None, "slices"):
                slices_w = SliceWorkload(duration=args.duration)
                results[kind]["slices"] = bench_slices(broker, slices_w, Path(tmp))
            if args.only in (None, "inherit"):
                results[kind]["inherit"] = bench_inherit(broker, args.inherit_backlog, 0.01, Path(tmp))
                if kind == "redis":
                    results["redis"]["boost_cost_s"] = bench_boost_cost()
            if args.only in (None, "recovery"):
                results[kind]["recovery"] = bench_recovery(broker, Path(tmp))
            if args.only == "chaos" and kind == "redis":
                results[kind]["chaos"] = bench_chaos(Path(tmp), args.duration * 4)
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(w), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
