"""``celery -A app prio exporter``: the fleet's figures for Prometheus, one exporter for all workers.

Each worker's own ``/metrics`` (``prio_metrics_port``) describes that worker;
an autoscaler needs one figure per tier for the whole fleet, which no single
worker knows. This exporter computes it at every scrape (``fleet.cluster_status``:
one ``inspect prio_stats`` broadcast and the broker's depths) and serves
``celery_prio_demand_slots{tier}`` (slots each tier needs, ``demand.py``)
beside the fleet's waiting, running, run-time estimate and worker count.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..settings import PrioSettings

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Metric names this exporter serves (the Kubernetes manifests' queries are checked against them).
FLEET_METRICS = (
    "celery_prio_demand_slots",
    "celery_prio_fleet_waiting",
    "celery_prio_fleet_running",
    "celery_prio_fleet_runtime_estimate_seconds",
    "celery_prio_fleet_workers",
)


class FleetCollector:
    def __init__(self, app: Celery, settings: PrioSettings) -> None:
        self.app, self.settings = app, settings

    def status(self) -> dict[str, Any]:
        from ..brokers import adapter_for
        from .fleet import cluster_status

        adapter = adapter_for(self.app)
        try:
            return cluster_status(self.app, self.settings, adapter)
        finally:
            adapter.close()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        data = self.status()
        families = {
            "celery_prio_demand_slots": (
                "Worker slots the tier needs now (running + waiting work over its target)",
                "demand_slots",
            ),
            "celery_prio_fleet_waiting": ("Messages waiting in the tier (queue, sub-queues, front lane)", "waiting"),
            "celery_prio_fleet_running": ("Tasks of the tier in a slot now, over all workers", "running"),
            "celery_prio_fleet_runtime_estimate_seconds": (
                "Run-time estimate of the tier's tasks",
                "runtime_estimate_s",
            ),
        }
        for name, (doc, key) in families.items():
            metric = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, row in data["tiers"].items():
                if row[key] is not None:
                    metric.add_metric([tier], float(row[key]))
            yield metric
        yield GaugeMetricFamily("celery_prio_fleet_workers", "Workers that answered", value=len(data["workers"]))


def serve_fleet_metrics(app: Celery, settings: PrioSettings, host: str, port: int) -> FleetCollector:
    from ..worker.metrics import serve_collector

    return serve_collector(FleetCollector(app, settings), host, port, "prio exporter")
