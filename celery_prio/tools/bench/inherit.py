"""Priority inheritance: a realtime caller waiting on an offline dependency; what a boost costs (``--only inherit``)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ...brokers import adapter_for
from ..benchapp import NATIVE_PRIORITY
from .core import BROKER_URLS, Run, broker_kind


def run_dependency_wait(mode: str, broker: str, backlog: int, seconds: float, logdir: Path) -> dict[str, Any]:
    """A realtime caller needs one offline task's output, published behind ``backlog`` offline tasks.

    ``native``: plain Celery with broker-native priorities (the dependency has offline's priority);
    ``prio``: celery-prio, the caller just waits; ``boost``: celery-prio, the caller boosts what it
    waits on to realtime first (what ``celery_prio.wait`` does). Returns the caller's wait.
    """
    from ...boost import boost
    from ...producer.bulk import bulk

    # Boost on RabbitMQ needs prio_boost_key where the broker URL is the well-known guest one (signing.py).
    keyed = {} if mode == "native" else {"boost_key": "celery-prio-bench-boost-key"}
    run = Run("native" if mode == "native" else "prio", broker, logdir, 4, **keyed)
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
    kind = broker_kind(broker)
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
    from ...boost import boost

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
