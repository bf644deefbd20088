"""The metrics reference page (``docs/reference/metrics.md``), generated from the collectors themselves.

``python -m celery_prio.ops.metrics_reference docs/reference/metrics.md`` writes it; ``tests/test_docs.py``
fails when the page and the collectors differ. Each collector is asked for its families with nothing to
report (a worker that has run nothing, an exporter that sees no worker): the families, their types, labels
and help texts are the same as in a scrape; only the samples are missing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..worker.metrics import PrioCollector
from .fleet_metrics import FleetCollector
from .reference_page import table_section, write_page

INTRO = """# Metrics reference

Each worker serves these on `/metrics` when `prio_metrics_port` is set
(its main process: prefork children record nothing, so no multiprocess
setup). `celery -A app prio exporter` serves the fleet's on one endpoint,
for KEDA and dashboards ([Scaling](../operations/scaling.md)). Counters
carry Prometheus' `_total` suffix; histograms `_bucket`, `_sum` and `_count`.
A `subqueue` label names the busiest queues of a tier, the rest as
`subqueue="other"`: its cardinality is bounded.

This page is generated from the collectors
(`python -m celery_prio.ops.metrics_reference docs/reference/metrics.md`).
"""


class _NothingToReport(PrioCollector):
    """A worker's collector before it has run anything, with no broker to ask for depths."""

    def __init__(self) -> None:
        report = SimpleNamespace(
            tiers={}, subqueues={}, unserved={}, stale_skipped=0, dead_letters=0, dead_dropped=0, held=0,
            discovery_problem=None,
        )  # fmt: skip
        runtime = SimpleNamespace(stats=SimpleNamespace(tiers={}))
        super().__init__(SimpleNamespace(report=lambda: report, runtime=runtime), app=None)

    def _depths(self) -> dict[str, int]:
        return {}


class _NoFleet(FleetCollector):
    def __init__(self) -> None:  # no app: status() is not asked
        pass

    def status(self) -> dict[str, Any]:
        return {"tiers": {}, "workers": []}


def _row(family: Any) -> str:
    suffix = {"counter": "_total", "histogram": "_bucket, _sum, _count"}.get(family.type, "")
    name = f"`{family.name}{suffix}`" if family.type != "histogram" else f"`{family.name}` (`{suffix}`)"
    labels = ", ".join(f"`{label}`" for label in getattr(family, "_labelnames", ())) or "—"
    return f"| {name} | {family.type} | {labels} | {family.documentation} |"


def markdown() -> str:
    out = [INTRO]
    for title, collector in (
        ("Each worker (`prio_metrics_port`)", _NothingToReport()),
        ("The fleet (`prio exporter`)", _NoFleet()),
    ):
        out += table_section(title, ["metric", "type", "labels", "meaning"], [_row(f) for f in collector.collect()])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return write_page(markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
