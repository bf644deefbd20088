"""compose/: valid against the Compose specification, and true to the project.

No Docker engine runs here, so the file is checked instead of run: the JSON
schema of the Compose specification (shipped by check-jsonschema), then every
module, queue, port and file it names is looked up in this repository.
"""

from __future__ import annotations

import importlib
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from celery_prio.settings import load_settings
from celery_prio.tiers import TIERS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_valid_against_the_compose_specification(compose):
    schema_file = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(compose, schema)  # raises with the path of the first violation
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["stop_grace_periodd"] = "10s"  # a typo the spec rejects
    with pytest.raises(jsonschema.ValidationError):  # the check has teeth
        jsonschema.validate(broken, schema)


def option(command: list[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def test_every_command_names_something_that_exists(compose, monkeypatch):
    monkeypatch.setenv("HTTP_API_KEYS", "compose-test-key")  # as compose/.env gives it (the door needs a key)
    services = compose["services"]
    prefix = load_settings({}).queue_prefix
    tier_queues = {f"{prefix}.{t.label}" for t in TIERS}
    for name in ("worker-realtime", "worker-shared", "http", "flower"):
        command = services[name]["command"]
        if command[0] == "celery":
            app_module = option(command, "-A")
            assert hasattr(importlib.import_module(app_module), "app"), f"{name}: -A {app_module} has no app"
            queues = option(command, "-Q")
            if queues:
                assert set(queues.split(",")) <= tier_queues, f"{name}: unknown queue in -Q {queues}"
        elif command[0] == "uvicorn":
            module, attr = command[1].split(":")
            assert hasattr(importlib.import_module(module), attr), f"{name}: {command[1]} does not exist"
            port = option(command, "--port")
            published = [p.split(":")[-1] for p in services[name]["ports"]]
            assert all(p.startswith(("127.0.0.1:", "${HTTP_BIND:-127.0.0.1}:")) for p in services[name]["ports"])
            assert port in published, f"{name}: listens on {port}, publishes {published}"
    assert option(services["worker-realtime"]["command"], "-Q") == f"{prefix}.realtime"
    assert option(services["worker-realtime"]["command"], "--gpus") is not None
    reservations = services["worker-realtime"]["deploy"]["resources"]["reservations"]["devices"]
    assert reservations[0]["capabilities"] == ["gpu"]


def test_build_context_and_mounted_files_exist(compose):
    build = compose["x-app"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    for line in (ROOT / "compose" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    for volume in compose["services"]["prometheus"]["volumes"]:
        assert (COMPOSE.parent / volume.split(":")[0]).is_file()


def test_prometheus_scrapes_the_port_workers_serve_metrics_on(compose):
    scrape = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    env_example = dict(
        line.split("=", 1)
        for line in (ROOT / "compose" / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    settings = load_settings({}, json.loads(env_example["PRIO_SETTINGS"]))  # also validates them
    assert settings.metrics_port is not None and settings.metrics_host == "0.0.0.0"
    for target in targets:
        host, port = target.split(":")
        assert host in compose["services"], f"prometheus scrapes unknown service {host}"
        assert int(port) == settings.metrics_port


def test_every_service_that_must_stay_up_has_a_healthcheck_or_depends_on_one(compose):
    services = compose["services"]
    for name in ("rabbitmq", "redis"):
        assert "healthcheck" in services[name]
    for dependency in compose["x-app"]["depends_on"].values():
        assert dependency["condition"] == "service_healthy"
    for name in ("worker-realtime", "worker-shared"):
        assert "stop_grace_period" in services[name]


def test_grafana_dashboard_uses_metrics_the_workers_export():
    dashboard = json.loads((ROOT / "compose" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    # What the workers export, as the generated metrics reference lists it (histograms: their _bucket series).
    reference = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    names = set(re.findall(r"`(celery_prio_[a-z_]+)`", reference))
    known = names | {n + "_bucket" for n in names}
    for expr in exprs:
        for name in re.findall(r"celery_prio_[a-z_]+", expr):
            assert name in known, f"dashboard queries {name}, which workers do not export"
