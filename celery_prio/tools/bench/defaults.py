"""What ``install(app)`` gives with nothing else set, cold, on stock brokers (``--only defaults``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..workers import free_port
from .core import Workload, broker_kind, management_api_answers, run_mixed
from .slices import SliceWorkload, run_sliced

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
    kind = broker_kind(broker)
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
        refused = (m["realtime"].get("refused", 0) if m else 0) + c1["realtime"].get("refused", 0)
        out(
            f"{name:<38}{mixed_cols}{c1['realtime']['p99_ms']:>13.0f}{c1_ratio:>10.2f}"
            f"{c1['batch_items_per_s']:>11.1f}{c1['offline_items_per_s']:>9.1f}"
            + (
                f"  (realtime refused: mix {m['realtime'].get('refused', 0) if m else 0}, "
                f"c1 {c1['realtime'].get('refused', 0)})"
                if refused
                else ""
            )
        )
    out("targets: overload-mix realtime P99 well under native priority's; -c 1 sliced realtime P99 <= 200 ms")
    results["ratios"] = ratios
    return results
