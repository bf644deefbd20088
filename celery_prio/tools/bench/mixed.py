"""The mixed workload side by side (FIFO, native priority, celery-prio), drains, publish rates, an aging pass."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...tiers import Tier
from ..workers import free_port
from .core import (
    AGING_OFF,
    AGING_OFFLINE_RATE,
    AGING_ON,
    BROKER_URLS,
    NO_CAPS,
    Run,
    Workload,
    best_of,
    broker_kind,
    interleaved,
    round_ratios,
    run_mixed,
)
from .scale import process_cpu

#: Interleaved rounds of the no-op drain (each setup once per round): its best and its per-round ratios.
DRAIN_ROUNDS = 3


def run_drain(
    mode: str,
    broker: str,
    n: int,
    concurrency: int,
    logdir: Path,
    seconds: float = 0.0,
    cpu: list[float] | None = None,
    **app_options: Any,
) -> float:
    """Tasks per second a worker drains from a pre-filled queue of tasks of ``seconds`` each (no-op by default).

    ``cpu``: appended the worker's main process CPU per task (ms) over the drain from its 10th task on: what a
    no-op drain is bound by (the pool children run nothing), and steadier than the rate on a small host."""
    run = Run(mode, broker, logdir, concurrency, **app_options)
    try:
        for _ in range(n):
            run.publish("batch", seconds)
        run.start_worker()
        key, deadline, pid = f"{run.prefix}:records", time.time() + 120, run.worker.pid if run.worker else 0
        cpu_from: tuple[float, int] | None = None
        while (done := run.records.llen(key)) < n and time.time() < deadline:
            if cpu_from is None and done >= 10:
                cpu_from = (process_cpu(pid), done)
            time.sleep(0.05)
        if cpu is not None and cpu_from is not None and done > cpu_from[1]:
            cpu.append(1000 * (process_cpu(pid) - cpu_from[0]) / (done - cpu_from[1]))
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
    from ...brokers.redis.admin import RedisAdapter
    from ...runtime import settings_for

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


def bench_drain(broker: str, w: Workload, drain_n: int, logdir: Path, out=print) -> dict[str, Any]:
    """Dispatch cost: a pre-filled queue drained by a default Celery worker and by a celery-prio one.

    On RabbitMQ both fetch modes are measured: ``get`` (the default, nothing held) and ``consume`` (pushed).
    """
    both_fetch_modes = broker_kind(broker) == "amqp"
    main_cpu: dict[str, list[float]] = {"fifo": [], "prio": []}  # the worker's main process, ms per task
    drain_setups: dict[str, tuple[str, dict[str, Any]]] = {
        "fifo": ("fifo", {"cpu": main_cpu["fifo"]}),
        "prio": ("prio", {"cpu": main_cpu["prio"]}),
        "prio_metrics": ("prio", {"metrics_port": free_port()}),
    }
    if both_fetch_modes:
        drain_setups["prio_consume"] = ("prio", {"fetch": "consume"})
    drain_rounds = interleaved(
        DRAIN_ROUNDS, drain_setups, lambda mode, **o: run_drain(mode, broker, drain_n, w.concurrency, logdir, **o)
    )
    drain = {name: max(rates) for name, rates in drain_rounds.items()}
    drain_ratio = drain["prio"] / drain["fifo"]
    metrics_ratio = drain["prio_metrics"] / drain["prio"]
    low, median, high = round_ratios(drain_rounds["prio"], drain_rounds["fifo"])
    out(
        f"no-op drain ({drain_n} tasks, concurrency {w.concurrency}): default Celery {drain['fifo']:.0f}/s, "
        f"celery-prio {drain['prio']:.0f}/s, ratio {drain_ratio:.2f} (target >= 0.8)"
    )
    # The best of each is what each can do; a no-op drain on a small host swings by a third from run to run
    # (plain Celery more than ours), so the rounds' own ratios are shown too.
    out(f"  ratio within each of {DRAIN_ROUNDS} rounds: median {median:.2f}, range {low:.2f}-{high:.2f}")
    cpu_ratio = None
    if main_cpu["fifo"] and main_cpu["prio"]:
        fifo_cpu, prio_cpu = statistics.median(main_cpu["fifo"]), statistics.median(main_cpu["prio"])
        cpu_ratio = prio_cpu / fifo_cpu
        out(
            f"  worker main process CPU per task (median of the rounds): default Celery {fifo_cpu:.3f} ms, "
            f"celery-prio {prio_cpu:.3f} ms, ratio {cpu_ratio:.2f} (a no-op drain is bound by it)"
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
        "drain_main_cpu_ms": {name: statistics.median(v) for name, v in main_cpu.items() if v},
        "drain_main_cpu_ratio": cpu_ratio,
        "drain_5ms_per_s": short,
        "drain_5ms_ratio": short_ratio,
    }
    if both_fetch_modes:
        out(f"  prio_fetch='consume': {short['prio_consume']:.0f}/s, ratio {short['prio_consume'] / short['fifo']:.2f}")
        results["drain_consume_ratio"] = drain["prio_consume"] / drain["fifo"]
        results["drain_5ms_consume_ratio"] = short["prio_consume"] / short["fifo"]
    return results


def bench_broker(broker: str, w: Workload, drain_n: int, publish_n: int, logdir: Path, out=print) -> dict[str, Any]:
    kind = broker_kind(broker)
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
