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
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from .adoption import bench_adoption
from .batching import bench_batching
from .bulk import bench_bulk
from .core import BROKER_URLS, DEFAULTS_RT_RATE, Workload, broker_kind
from .defaults import bench_defaults
from .inherit import bench_boost_cost, bench_inherit
from .mixed import bench_aging_pass, bench_broker, bench_drain
from .recovery import bench_chaos, bench_recovery
from .scale import bench_latency, bench_scale
from .slices import SliceWorkload, bench_slices
from .subqueues import bench_sjf, bench_subqueues
from .surge import bench_surge


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
        choices=(
            "defaults",
            "mixed",
            "drain",
            "bulk",
            "slices",
            "subqueues",
            "sjf",
            "inherit",
            "recovery",
            "chaos",
            "scale",
            "batching",
            "adoption",
            "surge",
        ),
        help="run one part: what a new user gets (defaults, cold, tiers per call and on the decorator), the "
        "mixed workload/drain/publish, the drains alone, bulk publish, GPU time slices, sub-queues, SJF, "
        "priority inheritance, recovery after a worker dies, chaos (kills and a broker restart), scale (idle "
        "and busy fleets), adoption (an app with its own queue and routes: plain Celery vs install()), "
        "surge (realtime above what the slots serve: admission and deadlines), "
        "or batching (the example CNN, batched or not; needs the demo extra; celery-batches' "
        "row: --batches-python); "
        "scale, chaos, surge and batching are not part of a full run",
    )
    parser.add_argument(
        "--scale-workers", default="1,16", help="idle fleet sizes for --only scale, comma-separated (e.g. 1,16,64)"
    )
    parser.add_argument("--scale-window", type=float, default=15.0, help="seconds an idle fleet is measured")
    parser.add_argument("--busy-workers", default="4,16,64", help="busy fleet sizes for --only scale")
    parser.add_argument("--busy-subqueues", default="0,50,500", help="tenant sub-queues served, busy sweep at 16")
    parser.add_argument("--inherit-backlog", type=int, default=2000, help="offline tasks ahead of the dependency")
    parser.add_argument(
        "--batches-python",
        help="--only batching: the interpreter of a virtualenv with celery-batches (it caps Celery below 5.7), "
        "for its row; without it the row runs only if celery-batches is installed here",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    w = Workload(duration=args.duration, concurrency=args.concurrency, rt_rate=args.rt_rate)
    brokers = [BROKER_URLS.get(b, b) for b in (args.broker or ["redis", "amqp"])]
    results = {}
    with tempfile.TemporaryDirectory(prefix="celery-prio-bench-") as tmp:
        for broker in brokers:
            kind = broker_kind(broker)
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
            if args.only in (None, "adoption"):
                results[kind]["adoption"] = bench_adoption(broker, Path(tmp))
            if args.only in (None, "recovery"):
                results[kind]["recovery"] = bench_recovery(broker, Path(tmp))
            if args.only == "batching":
                results[kind]["batching"] = bench_batching(
                    broker, Path(tmp), seconds=args.duration, batches_python=args.batches_python
                )
            if args.only == "scale":
                sizes = tuple(int(n) for n in args.scale_workers.split(","))
                busy = tuple(int(n) for n in args.busy_workers.split(","))
                subqueues = tuple(int(n) for n in args.busy_subqueues.split(","))
                results[kind]["scale"] = bench_scale(
                    broker, Path(tmp), sizes, args.scale_window, busy_sizes=busy, busy_subqueues=subqueues
                )
                results[kind]["latency"] = bench_latency(broker, Path(tmp), args.duration)
            if args.only == "surge":
                results[kind]["surge"] = bench_surge(broker, Path(tmp), duration=min(args.duration, 8.0))
            if args.only == "chaos" and kind == "redis":
                results[kind]["chaos"] = bench_chaos(Path(tmp), args.duration * 4)
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(w), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
