"""A chaos run (issue 26): real workers SIGKILLed and restarted in place, and the broker restarted, under
a mixed load, then a check that nothing was lost or run twice where the docs promise once.

The load uses every path that has state on the broker: realtime's shortest-first queues, batch and
offline tier queues with aging, tenant sub-queues filled by ``bulk``, sliced tasks (continuations),
boosts of queued offline tasks, chords whose header calls run as batches, and long tasks. Every task
is ``acks_late``: a task whose worker is killed while it runs comes back and runs again (at-least-once,
Celery's semantics), which the check tells apart from an unexplained second run. The first worker
runs ``-P solo`` and starts first, so it holds the housekeeper lease while its long tasks block its
event loop. The broker is a private ``redis-server`` with an append-only file (fsync always),
SIGKILLed once mid-run and started again from its file, and later made a replica (``REPLICAOF``, as
a failover does: every write refused with ``READONLY``) for a moment and primary again.

``celery-prio bench --only chaos`` runs it longer; ``tests/test_chaos.py`` runs a short one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from .workers import WorkerProcess, free_port

#: Bounds short enough for a short run to see every recovery (the defaults are 5/10/10 s).
FAST_BOUNDS = {"realtime": 2, "batch": 3, "offline": 3}
#: Slack after a first run's end in which a kill (or the broker restart) explains a second run: the ack
#: follows the end, and a message whose ack was cut off comes back.
ACK_WINDOW = 1.5


@dataclass
class ChaosResult:
    accepted: Counter = field(default_factory=Counter)  # per kind of publish
    refused: int = 0  # publishes that failed (the broker was down): not accepted, not counted
    completed: int = 0
    lost: list[str] = field(default_factory=list)  # accepted, never completed, not marked expired
    lost_why: dict[str, str] = field(default_factory=dict)  # a lost chord body's state, as its result says
    expired: int = 0  # realtime calls past their deadline (a kill delayed them): marked REVOKED, never run
    kills: int = 0
    broker_restarts: int = 0
    failovers: int = 0  # REPLICAOF a master that is not there, then REPLICAOF NO ONE
    boosts: int = 0
    cut_off_and_run_again: int = 0  # started again after its worker was killed mid-run, completed once
    ran_again_after_a_kill: int = 0  # a second completion a kill or the broker restart explains
    ran_twice_unexplained: list[str] = field(default_factory=list)
    sliced_wrong: list[str] = field(default_factory=list)  # a sliced result with an element missing or twice
    left_unacked: int = 0
    left_owners: int = 0
    drain_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.lost or self.ran_twice_unexplained or self.sliced_wrong or self.left_unacked or self.left_owners
        )

    def lines(self) -> list[str]:
        accepted = ", ".join(f"{k} {v}" for k, v in sorted(self.accepted.items()))
        return [
            f"accepted {sum(self.accepted.values())} ({accepted}); refused while the broker was down {self.refused}",
            f"worker SIGKILLs + restarts in place {self.kills}; broker restarts {self.broker_restarts}; "
            f"replica-and-back failovers {self.failovers}; boosts {self.boosts}",
            f"completed {self.completed}; expired past the realtime deadline {self.expired}; lost {len(self.lost)}; "
            f"drained {self.drain_s:.1f} s after the chaos",
            f"cut off by a kill and run again {self.cut_off_and_run_again}; "
            f"completed twice, a kill explains it (acks_late) {self.ran_again_after_a_kill}; "
            f"ran twice unexplained {len(self.ran_twice_unexplained)}; sliced results wrong {len(self.sliced_wrong)}",
            f"left in unacked {self.left_unacked}; left in owners {self.left_owners}",
            *(f"lost {tag}: {why}" for tag, why in self.lost_why.items()),
        ]


def redis_server(port: int, directory: Path) -> subprocess.Popen:
    """A private redis-server on ``port`` with an append-only file (fsync always) in ``directory``, up."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if redis.Redis(port=port).ping():
                return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


class _Fleet:
    """The workers, each restartable in place under its node name."""

    def __init__(self, workdir: Path, env: dict[str, str], n: int, prefix: str) -> None:
        self.workdir, self.env = workdir, env
        self.names = [f"chaos{i}-{prefix}@%h" for i in range(n)]
        self.procs: list[WorkerProcess] = []
        self.kills: dict[str, list[float]] = defaultdict(list)  # node name (before '@') -> kill times
        self.starts = 0
        for name in self.names:  # the solo one first, alone: it takes the housekeeper lease
            self.procs.append(self._start(name, wait=True))

    def _start(self, name: str, wait: bool) -> WorkerProcess:
        self.starts += 1
        solo = name == self.names[0]  # a GPU layout: one process, tasks on the event loop's thread
        proc = WorkerProcess(
            "celery_prio.tools.chaosapp",
            log_path=self.workdir / f"worker{self.starts}.log",
            concurrency=1 if solo else 2,
            pool="solo" if solo else "prefork",
            hostname=name,
            env=self.env,
        )
        return proc.wait_ready() if wait else proc

    def kill_and_restart(self, i: int) -> None:
        self.procs[i].kill()  # SIGKILL, the pool too: an OOM kill
        self.kills[self.names[i].split("@")[0]].append(time.time())
        self.procs[i] = self._start(self.names[i], wait=False)  # the same name: a new incarnation

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


#: The chaos run's ``prio_boost_key`` (it boosts on RabbitMQ as a guest).
CHAOS_BOOST_KEY = "celery-prio-chaos-boost-key"


def run_chaos(
    workdir: Path,
    duration: float = 20.0,
    workers: int = 3,
    seed: int = 1,
    record_url: str = "redis://127.0.0.1:6379/14",
    settings: dict[str, Any] | None = None,
    kill_every: float = 4.0,
    rate: float = 20.0,
    drain_timeout: float = 120.0,
    out=print,
) -> ChaosResult:
    """One chaos run; ``settings`` go to ``install()`` (default: ``FAST_BOUNDS`` and aging offline 2 s)."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("the chaos run needs a redis-server binary (it restarts its own broker)")
    from .chaosapp import make_app

    rng = random.Random(seed)
    prefix = f"chaos{uuid.uuid4().hex[:8]}"
    port = free_port()
    broker_url = f"redis://127.0.0.1:{port}/0"
    # Boost on RabbitMQ needs prio_boost_key where the broker URL is the well-known guest one (signing.py).
    settings = {
        "redeliver_after": FAST_BOUNDS,
        "aging": {"offline": 2},
        "boost_key": CHAOS_BOOST_KEY,
        **(settings or {}),
    }
    server = redis_server(port, workdir / "broker")
    recorder = redis.Redis.from_url(record_url)
    env = {
        **os.environ,
        "CHAOS_BROKER": broker_url,
        "CHAOS_BACKEND": record_url,
        "CHAOS_RECORD": record_url,
        "CHAOS_PREFIX": prefix,
        "CHAOS_SETTINGS": json.dumps(settings),
    }
    app = make_app(broker_url, record_url, record_url, prefix, settings)
    result = ChaosResult()
    fleet = _Fleet(workdir, env, workers, prefix)
    restarts: list[float] = []
    failovers: list[float] = []
    stop = threading.Event()
    broker_lock = threading.Lock()

    def chaos() -> None:
        nonlocal server
        restarted = False
        while not stop.wait(kill_every * rng.uniform(0.6, 1.4)):
            fleet.kill_and_restart(rng.randrange(workers))
            result.kills += 1
            if not restarted and time.monotonic() - began > duration / 2:
                with broker_lock:
                    server.kill()  # SIGKILL the broker; it comes back from its append-only file
                    server.wait(10)
                    restarts.append(time.time())
                    time.sleep(1.0)
                    server = redis_server(port, workdir / "broker")
                restarted = True
                result.broker_restarts += 1

    def failover() -> None:
        if stop.wait(duration * 3 / 4):
            return
        with broker_lock:
            primary = redis.Redis(port=port)
            primary.replicaof("127.0.0.1", free_port())  # a master that is not there: every write refused
            failovers.append(time.time())
            time.sleep(1.5)
            primary.replicaof("NO", "ONE")  # primary again, its data kept
        result.failovers += 1

    accepted: dict[str, str] = {}  # tag -> kind
    realtime: dict[str, Any] = {}  # tag -> result: a call a kill delayed past its deadline is marked expired
    sliced: dict[str, tuple[Any, int]] = {}  # tag -> (result, n)
    offline: list[Any] = []
    boosted: set[str] = set()
    bodies: dict[str, Any] = {}  # chord tag -> its body's result: why a lost body never ran
    began = time.monotonic()
    killer = threading.Thread(target=chaos, name="chaos", daemon=True)
    killer.start()
    replica = threading.Thread(target=failover, name="failover", daemon=True)
    replica.start()
    import celery_prio

    work, sliced_task = app.tasks["chaos.work"], app.tasks["chaos.sliced"]
    n = 0
    try:
        while time.monotonic() - began < duration:
            time.sleep(rng.expovariate(rate))
            n += 1
            kinds = ["realtime", "batch", "offline", "bulk", "sliced", "boost", "chord", "long"]
            kind = rng.choices(kinds, [30, 25, 15, 10, 10, 10, 8, 4])[0]
            try:
                if kind in ("realtime", "batch", "offline"):
                    tag = f"{kind}-{n}"
                    seconds = {"realtime": 0.02, "batch": 0.1, "offline": 0.8}[kind]
                    res = work.apply_async((tag, seconds), tier=kind)
                    if kind == "offline":
                        offline.append((tag, res))
                    if kind == "realtime":
                        realtime[tag] = res
                    accepted[tag] = kind
                elif kind == "bulk":
                    tags = [f"bulk-{n}-{i}" for i in range(10)]
                    celery_prio.bulk(work, [(t, 0.05) for t in tags], tier="batch", subqueue=f"tenant-{n % 3}")
                    accepted.update(dict.fromkeys(tags, "bulk"))
                elif kind == "chord":
                    tags, bodies[f"chord-{n}"] = app.chaos_chord(f"chord-{n}", 4)
                    accepted.update(dict.fromkeys(tags, "chord"))
                elif kind == "long":
                    tag = f"long-{n}"
                    app.tasks["chaos.long"].apply_async((tag, 2.5))
                    accepted[tag] = "long"
                elif kind == "sliced":
                    tag = f"sliced-{n}"
                    sliced[tag] = (sliced_task.apply_async((tag, 10, 0.05)), 10)
                    accepted[tag] = "sliced"
                elif offline:
                    tag, res = rng.choice(offline[-10:])  # a recent one: likely still queued
                    if celery_prio.boost(res, "realtime").lifted:
                        boosted.add(tag)
                        result.boosts += 1
            except Exception:  # the broker is down (its restart): this publish was not accepted
                result.refused += 1
    finally:
        stop.set()
        killer.join(30)
        replica.join(30)
    result.accepted = Counter(accepted.values())
    key = f"{prefix}:chaos"

    def events() -> list[dict[str, Any]]:
        return [json.loads(x) for x in recorder.lrange(key, 0, -1)]

    def expired(ended: set[str]) -> set[str]:
        """Realtime calls not run that Celery marked expired (``prio_realtime_deadline``): accounted for."""
        return {tag for tag, res in realtime.items() if tag not in ended and res.state == "REVOKED"}

    drained_from = time.monotonic()
    ended: set[str] = set()
    while time.monotonic() - drained_from < drain_timeout:
        ended = {e["tag"] for e in events() if e["kind"] == "end"}
        if set(accepted) <= ended | expired(ended):
            break
        time.sleep(0.5)
    result.drain_s = time.monotonic() - drained_from
    log = events()
    gone_by_deadline = expired(ended)
    result.expired = len(gone_by_deadline)
    result.lost = sorted(set(accepted) - ended - gone_by_deadline)
    for tag in result.lost:
        if tag in bodies:  # a body Celery could not publish is marked failed (ChordError), not left pending
            body = bodies[tag]
            result.lost_why[tag] = f"{body.state}: {body.result!r}"
    result.completed = len(set(accepted) & ended)
    by_tag: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in log:
        by_tag[e["tag"]].append(e)
    for tag in accepted:
        ends = [e for e in by_tag[tag] if e["kind"] == "end"]
        if len(ends) < 2:
            result.cut_off_and_run_again += sum(e["kind"] == "start" for e in by_tag[tag]) > 1
            continue
        first_start = (
            min(e["t"] for e in by_tag[tag] if e["kind"] == "start")
            if any(e["kind"] == "start" for e in by_tag[tag])
            else ends[0]["t"]
        )
        window = (first_start, ends[0]["t"] + ACK_WINDOW)
        nodes = {e["worker"].split("@")[0] for e in by_tag[tag]}
        explained = any(window[0] <= t <= window[1] for node in nodes for t in fleet.kills.get(node, []))
        explained = explained or any(window[0] - 1 <= t <= window[1] for t in restarts)
        # Writes refused for a moment (the failover): an ack lost then brings the message back.
        explained = explained or any(window[0] - 1 <= t <= window[1] + 1.5 for t in failovers)
        if explained:
            result.ran_again_after_a_kill += 1
        else:
            result.ran_twice_unexplained.append(tag)
    for tag, (res, size) in sliced.items():
        try:
            value = res.get(timeout=5)
        except Exception as exc:
            result.sliced_wrong.append(f"{tag}: {exc!r}")
            continue
        if sorted(value) != list(range(size)):
            result.sliced_wrong.append(f"{tag}: {value}")
    # Nothing left behind: every worker alive holds nothing, a killed one's entries were swept.
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        result.left_unacked = client.hlen(f"{prefix}.unacked")
        result.left_owners = client.hlen(f"{prefix}.owners")
        if not (result.left_unacked or result.left_owners):
            break
        time.sleep(0.5)
    fleet.stop()
    server.kill()
    server.wait(10)
    recorder.delete(key)
    for line in result.lines():
        out(f"  {line}")
    return result
