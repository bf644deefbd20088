"""Workloads for the policy simulator: a small spec (YAML or JSON) or a trace recorded by real workers.

A spec::

    duration: 20          # seconds of arrivals
    workers: 1
    concurrency: 4
    overhead_ms: 4        # per task, on top of its run time (fetch round trips, pool hand-off)
    streams:
      - {tier: realtime, rate: 30, seconds: 0.02}                 # Poisson, 30/s
      - {tier: batch, backlog: 1200, seconds: 0.1}                # queued at t=0
      - {tier: offline, backlog: 20, seconds: {dist: exponential, mean: 2.0}, elements: 20}

A trace (``prio_trace_file``): each finished task's tier, queue, name,
enqueue, start and end time, replayed with the recorded arrivals and run
times. ``parse_override`` reads the ``--set name=value`` options of
``prio simulate``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tiers import TIERS, Tier, parse_tier

DISTRIBUTIONS = ("fixed", "exponential", "uniform", "lognormal")


@dataclass(frozen=True)
class RunTime:
    """A run-time distribution in seconds."""

    dist: str = "fixed"
    mean: float = 0.1
    low: float = 0.0
    high: float = 0.0
    sigma: float = 0.5

    @classmethod
    def parse(cls, raw: Any, where: str) -> RunTime:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return cls(mean=float(raw))
        if not isinstance(raw, Mapping) or raw.get("dist", "fixed") not in DISTRIBUTIONS:
            raise ValueError(f"{where}: seconds must be a number or {{dist: {'|'.join(DISTRIBUTIONS)}, ...}}")
        out = cls(**{k: float(v) if k != "dist" else v for k, v in raw.items()})
        if out.dist == "uniform" and not 0 <= out.low <= out.high:
            raise ValueError(f"{where}: uniform needs 0 <= low <= high")
        if out.dist != "uniform" and out.mean < 0:
            raise ValueError(f"{where}: mean must be >= 0")
        return out

    def sample(self, rng: random.Random) -> float:
        if self.dist == "exponential":
            return rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high)
        if self.dist == "lognormal":  # ``mean`` is the distribution's mean
            mu = math.log(self.mean) - self.sigma**2 / 2 if self.mean > 0 else 0.0
            return rng.lognormvariate(mu, self.sigma) if self.mean > 0 else 0.0
        return self.mean


@dataclass(frozen=True)
class Stream:
    tier: Tier
    seconds: RunTime
    rate: float = 0.0  # Poisson arrivals per second during the run
    backlog: int = 0  # queued at t=0
    elements: int = 0  # > 0: a sliced task (celery_prio.slices) of this many equal elements
    name: str = ""


@dataclass
class Workload:
    duration: float
    streams: list[Stream]
    workers: int = 1
    concurrency: int = 4
    # A real worker's realtime P50 minus the task's run time, the demo's shape on this project's 2-core box with
    # Redis (2026-12-07: 3.8-4.1 ms); tests/test_simulate.py compares the model with real runs.
    overhead_s: float = 0.004
    grace: float = 3.0  # simulated time after the arrivals end, for what is still running
    seed: int = 7
    arrivals: list[tuple[float, Stream, float]] | None = None  # a trace: (at, stream, run time)
    queues: frozenset[str] = frozenset()  # a trace: the queues its tasks were fetched from

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Workload:
        if not isinstance(spec, Mapping) or not isinstance(spec.get("streams"), list) or not spec["streams"]:
            raise ValueError("a workload spec needs a non-empty 'streams' list")
        streams = []
        for i, raw in enumerate(spec["streams"]):
            where = f"streams[{i}]"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{where} must be a mapping")
            unknown = set(raw) - {"tier", "seconds", "rate", "backlog", "elements", "name"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
            stream = Stream(
                tier=parse_tier(raw.get("tier"), what=f"{where}.tier"),
                seconds=RunTime.parse(raw.get("seconds", 0.1), where),
                rate=float(raw.get("rate", 0.0)),
                backlog=int(raw.get("backlog", 0)),
                elements=int(raw.get("elements", 0)),
                name=str(raw.get("name", "")),
            )
            if stream.rate < 0 or stream.backlog < 0 or stream.elements < 0:
                raise ValueError(f"{where}: rate, backlog and elements must be >= 0")
            streams.append(stream)
        workload = cls(
            duration=float(spec.get("duration", 20.0)),
            streams=streams,
            workers=int(spec.get("workers", 1)),
            concurrency=int(spec.get("concurrency", 4)),
            overhead_s=float(spec.get("overhead_ms", 4.0)) / 1000.0,
            grace=float(spec.get("grace", 3.0)),
            seed=int(spec.get("seed", 7)),
        )
        if workload.duration <= 0 or workload.workers < 1 or workload.concurrency < 1:
            raise ValueError("duration must be > 0, workers and concurrency >= 1")
        return workload

    @classmethod
    def from_trace(cls, rows: list[Mapping[str, Any]], workers: int, concurrency: int) -> Workload:
        """A recorded trace (``prio_trace_file`` rows): arrivals and run times as they were."""
        usable = [r for r in rows if isinstance(r, Mapping) and _trace_row_ok(r)]
        if not usable:
            raise ValueError("the trace has no usable rows (tier, enqueued_at, start, end)")
        t0 = min(float(r["enqueued_at"]) for r in usable)
        streams: dict[tuple[Tier, str], Stream] = {}
        arrivals = []
        for r in usable:
            tier = parse_tier(r["tier"])
            key = (tier, str(r.get("task", "")))
            stream = streams.setdefault(key, Stream(tier=tier, seconds=RunTime(), name=key[1]))
            arrivals.append((float(r["enqueued_at"]) - t0, stream, max(float(r["end"]) - float(r["start"]), 0.0)))
        arrivals.sort(key=lambda a: a[0])
        duration = max(a[0] for a in arrivals) + 1e-3
        queues = frozenset(str(r["queue"]) for r in usable if isinstance(r.get("queue"), str))
        return cls(duration, list(streams.values()), workers, concurrency, arrivals=arrivals, queues=queues)


def _trace_row_ok(row: Mapping[str, Any]) -> bool:
    try:
        parse_tier(row["tier"])
        return all(math.isfinite(float(row[k])) for k in ("enqueued_at", "start", "end"))
    except (KeyError, TypeError, ValueError):
        return False


def workload_of(bench: Any, overhead_s: float = Workload.overhead_s) -> Workload:
    """The simulator's form of a ``celery-prio bench`` mixed workload (``tools.bench.Workload``)."""
    streams = [
        Stream(Tier.REALTIME, RunTime(mean=bench.rt_seconds), rate=bench.rt_rate),
        Stream(Tier.BATCH, RunTime(mean=bench.batch_seconds), backlog=bench.batch_backlog),
        Stream(
            Tier.OFFLINE, RunTime(mean=bench.offline_seconds), backlog=bench.offline_backlog, rate=bench.offline_rate
        ),
    ]
    return Workload(bench.duration, streams, 1, bench.concurrency, overhead_s, bench.grace, bench.seed)


def load_workload(path: Path, workers: int | None = None, concurrency: int | None = None) -> Workload:
    """A spec (``.yaml``/``.yml``/``.json``) or a trace (``.jsonl``: one recorded task a line)."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn last line of a file being written
        return Workload.from_trace(rows, workers or 1, concurrency or 4)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    workload = Workload.from_spec(spec)
    if workers:
        workload.workers = workers
    if concurrency:
        workload.concurrency = concurrency
    return workload


def parse_override(text: str) -> tuple[str, Any]:
    """``weights=4,2,1`` / ``aging=offline:30,batch:none`` / ``reserve=0`` / ``idle_share=next_below``."""
    name, sep, raw = text.partition("=")
    name = name.strip().removeprefix("prio_")
    if not sep or not name:
        raise ValueError(f"--set takes name=value, got {text!r}")
    return name, _value(raw.strip())


def _scalar(raw: str) -> Any:
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw


def _value(raw: str) -> Any:
    parts = [p.strip() for p in raw.split(",")] if "," in raw or ":" in raw else None
    if parts is None:
        return _scalar(raw)
    if all(":" in p for p in parts):
        return {k.strip(): _scalar(v.strip()) for k, v in (p.split(":", 1) for p in parts)}
    if len(parts) == len(TIERS):
        return {t.label: _scalar(p) for t, p in zip(TIERS, parts, strict=True)}
    raise ValueError(f"cannot read {raw!r}: give one value, three (realtime,batch,offline) or tier:value pairs")
