"""compose/kubernetes/: valid Kubernetes and KEDA objects, and true to this repository.

No cluster runs here, so the manifests are checked instead of applied:
Kubernetes objects with kubernetes-validate in strict mode (unknown fields
rejected), KEDA objects against the ScaledObject and TriggerAuthentication
schemas taken from KEDA's own CRDs (``tests/schemas/``, walked strictly
too), then every queue, metric, port, image and name they mention is looked
up in the code and the other manifests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from celery_prio.ops.fleet_metrics import FLEET_METRICS
from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS, Tier

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "compose" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.30.0"
KEDA_SCHEMAS = {"ScaledObject": "keda-scaledobject", "TriggerAuthentication": "keda-triggerauthentication"}


def documents() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


DOCS = documents()


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def strict_problems(value, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not know (CRD schemas allow any by default; kubectl --validate=strict does not)."""
    problems = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                problems.append(f"{path}.{key}")
            else:
                problems += strict_problems(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += strict_problems(item, schema["items"], f"{path}[{i}]")
    return problems


def keda_schema(kind: str) -> dict:
    return json.loads((SCHEMAS / f"{KEDA_SCHEMAS[kind]}.schema.json").read_text())


def test_the_manifests_hold_the_objects_a_deployment_needs():
    kinds = sorted({(d["kind"], d["metadata"]["name"]) for d in DOCS})
    deployments = by_kind("Deployment")
    assert {"worker-realtime", "worker-shared", "worker-offline", "http", "prio-exporter"} <= set(deployments)
    assert {"http", "prio-exporter", "worker-metrics", "prometheus"} <= set(by_kind("Service")), kinds
    assert set(by_kind("ScaledObject")) == {"worker-realtime", "worker-shared", "worker-offline"}
    assert by_kind("TriggerAuthentication")


def test_kubernetes_objects_are_valid_in_strict_mode():
    import kubernetes_validate

    objects = [d for d in DOCS if d["kind"] not in KEDA_SCHEMAS]
    for doc in objects:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(by_kind("Deployment")["worker-realtime"]))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 30  # a typo strict mode rejects
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_keda_objects_match_kedas_own_schemas():
    for kind in KEDA_SCHEMAS:
        schema = keda_schema(kind)
        for doc in by_kind(kind).values():
            jsonschema.validate(doc, schema)
            assert strict_problems(doc, schema) == [], doc["metadata"]["name"]
    broken = json.loads(json.dumps(by_kind("ScaledObject")["worker-offline"]))
    broken["spec"]["minReplicaCount"] = "zero"
    with pytest.raises(jsonschema.ValidationError):  # the check has teeth
        jsonschema.validate(broken, keda_schema("ScaledObject"))
    broken["spec"]["minReplicaCount"] = 0
    broken["spec"]["minReplicas"] = 0
    assert strict_problems(broken, keda_schema("ScaledObject")) == [".spec.minReplicas"]


def settings():
    config = by_kind("ConfigMap")["celery-prio-settings"]
    return load_settings({}, json.loads(config["data"]["PRIO_SETTINGS"]))


def containers(name: str) -> list[dict]:
    return by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"]


def option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_every_image_is_the_one_compose_builds():
    compose = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
    image = compose["x-app"]["image"]
    ours = [c["image"] for d in by_kind("Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]]
    assert {i for i in ours if not i.startswith("prom/")} == {image}


def test_worker_queues_ports_and_resources_are_the_settings():
    s = settings()
    tier_queues = {s.queue_name(t) for t in TIERS}
    for name in ("worker-realtime", "worker-shared", "worker-offline"):
        (worker,) = containers(name)
        command = worker["command"]
        assert command[:4] == ["celery", "-A", "tasks", "worker"], command
        queues = option(command, "-Q").split(",")
        assert set(queues) <= tier_queues, (name, queues)
        assert [p["containerPort"] for p in worker["ports"]] == [s.metrics_port]
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
        env = {e["name"]: e for e in worker["env"]}
        assert env["PRIO_SETTINGS"]["valueFrom"]["configMapKeyRef"]["name"] == "celery-prio-settings"
    assert option(containers("worker-realtime")[0]["command"], "-Q") == s.queue_name(Tier.REALTIME)
    assert s.metrics_host == "0.0.0.0"  # reachable from Prometheus in another pod


def test_grace_periods_cover_a_warm_shutdown():
    deployments = by_kind("Deployment")
    grace = {
        n: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        for n, d in deployments.items()
        if "worker" in n
    }
    assert grace["worker-realtime"] >= 30
    # Batch and offline tasks run for minutes; a sliced one still finishes its run on a warm shutdown.
    assert grace["worker-shared"] >= 300 and grace["worker-offline"] >= 300


def test_scaled_objects_target_real_deployments_and_real_signals():
    s = settings()
    deployments = by_kind("Deployment")
    exporter = containers("prio-exporter")[0]
    assert exporter["command"][:5] == ["celery", "-A", "tasks", "prio", "exporter"]
    port = int(option(exporter["command"], "--port"))
    assert exporter["ports"][0]["containerPort"] == port
    assert by_kind("Service")["prio-exporter"]["spec"]["ports"][0]["port"] == port
    assert f"prio-exporter:{port}" in by_kind("ConfigMap")["prometheus-config"]["data"]["prometheus.yml"]
    slots = {}
    for name, scaled in by_kind("ScaledObject").items():
        target = scaled["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        command = containers(target)[0]["command"]
        concurrency = int(option(command, "-c"))
        queues = option(command, "-Q").split(",")
        for trigger in scaled["spec"]["triggers"]:
            meta = trigger["metadata"]
            if trigger["type"] == "prometheus":
                metric, tier = re.fullmatch(r'sum\((\w+)\{tier="(\w+)"\}\)', meta["query"]).groups()
                assert metric in FLEET_METRICS and metric == "celery_prio_demand_slots"
                assert s.queue_name(Tier[tier.upper()]) in queues  # the pool serves the tier it scales on
                assert meta["serverAddress"] == "http://prometheus:9090"
                reserve = 0 if tier == "realtime" else s.effective_reserve(concurrency)
                slots[name] = (int(meta["threshold"]), concurrency - reserve)
            else:
                assert trigger["type"] == "rabbitmq" and meta["protocol"] == "http"
                pattern = re.compile(meta["queueName"])
                counted = [
                    s.queue_name(Tier.BATCH),
                    s.queue_name(Tier.OFFLINE),
                    s.queue_name(Tier.OFFLINE) + ".promoted",
                ]
                counted += [s.subqueue_name(Tier.BATCH, "acme"), s.subqueue_name(Tier.OFFLINE, "eval-7")]
                assert all(pattern.fullmatch(q) for q in counted)
                assert not pattern.fullmatch(s.queue_name(Tier.REALTIME)) and not pattern.fullmatch(s.dead_letter_queue)
                assert {s.queue_name(Tier.BATCH), s.queue_name(Tier.OFFLINE)} == set(queues)
                auth = by_kind("TriggerAuthentication")[trigger["authenticationRef"]["name"]]
                (secret,) = auth["spec"]["secretTargetRef"]
                assert secret["parameter"] == "host" and secret["key"] in (K8S / "config.yaml").read_text()
        assert scaled["spec"]["minReplicaCount"] == (0 if name == "worker-offline" else 1)
    for name, (threshold, offered) in slots.items():
        assert threshold == offered, name  # one replica's worth of the tier's slots
