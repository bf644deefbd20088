"""``prio_*`` settings: defaults, parsing and validation.

Everything is validated once, at ``install()`` and again at worker start
(where the pool size is known), and every error names the setting and the
offending value. Per-tier settings accept a dict keyed by any tier alias.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import math
import re
import types
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError
from .headers import PROMOTED_SUFFIX
from .tiers import TIERS, Tier, parse_tier

OVERFLOW_POLICIES = ("reject", "drop_oldest")
QUEUE_TYPES = ("classic", "quorum")  # RabbitMQ's; Celery's task_default_queue_type takes the same two
#: Workers beat every second: a worker is taken for gone only after missing a few beats.
MIN_REDELIVER_AFTER = 2.0
SCHEDULER_MODES = ("time", "count")
IDLE_SHARE_RULES = ("proportional", "next_below")  # scheduler.IDLE_SHARE_RULES: settings stays import-light
FETCH_MODES = ("get", "consume")
#: Default slice length as a fraction of ``prio_realtime_target``. A realtime arrival on a busy
#: one-slot worker waits for the rest of the running slice plus the element in progress, so with
#: elements up to half the target, half the target for the slice keeps the total inside it.
SLICE_FRACTION = 0.5


def derived_slices(realtime_target: float) -> dict[str, float | None]:
    """The slice lengths ``prio_slice`` defaults to: realtime never yields, batch and offline after a fraction."""
    return {"realtime": None, "batch": realtime_target * SLICE_FRACTION, "offline": realtime_target * SLICE_FRACTION}


DEFAULTS: dict[str, Any] = {
    "weights": {"realtime": 8, "batch": 2, "offline": 1},
    "reserve": None,  # None = 1 slot when concurrency >= 2, else 0
    "min_share": 5,  # offline's floor while it has work: per cent of slot time (count mode: dispatches per 100)
    "aging": {"realtime": None, "batch": 1800, "offline": 1800},
    # The seed's realtime latency target (seconds, P99): what the derived defaults below are made from.
    "realtime_target": 0.2,
    # GPU time slices: a task looping through celery_prio.slices() gives its slot back after
    # holding it this long (seconds) when a higher tier waits. Realtime never yields. None (the
    # default): SLICE_FRACTION of prio_realtime_target for batch and offline; a dict overrides per tier.
    "slice": None,
    # Sub-queues inside a tier (tenants, jobs): <prefix>.<tier>.<name>, sharing the tier's slot time by run time.
    "subqueue_weights": {},  # {"batch": {"acme": 3}}: weight of a sub-queue inside its tier (default 1)
    "subqueue_key": None,  # callable(task_name, args, kwargs, options) -> sub-queue or None; or "module:function"
    "subqueue_max_length": {"realtime": None, "batch": None, "offline": None},  # each sub-queue's cap; None: tier's
    # Shortest job first inside realtime: each task name gets its own sub-queue (sjf-<name>) and a worker
    # takes the head with the shortest expected run, but puts every one first at least every sjf_max_wait s.
    # Priority inheritance at publish time: chain/chord steps a higher tier waits on run at its tier;
    # children of a running task that name no tier run at the parent's.
    "inherit": True,
    # celery_prio.boost on RabbitMQ: how long to wait for every worker to confirm it will skip the stale
    # original, and how many recently published batch/offline tasks a process remembers (what it can boost).
    "boost_timeout": 1.0,
    "boost_memory": 10_000,
    # ... and the key its journal records are signed with (None: derived from the broker URL and the prefix).
    "boost_key": None,
    # ... and at most this many bytes of their messages (a batch of 4,096 images is big; oldest forgotten first).
    "boost_memory_bytes": 64 * 1024 * 1024,
    # Dead letters kept at most (the oldest beyond it are dropped and counted); None: no cap.
    "dead_letter_max": 100_000,
    # Redis: a worker, sub-queue or estimate not heard of for this many seconds is pruned from the
    # fleet's hashes (heartbeats, serving, rates, estimates, the sub-queue registry).
    "prune_after": 7 * 86400,
    # The demand signal (prio status, prio exporter): seconds in which each tier's waiting work should drain.
    "demand_target": {"realtime": 0.2, "batch": 300, "offline": 3600},
    # prio simulate --trace: each worker appends what it ran to this file (JSON lines), at most trace_max lines.
    "trace_file": None,
    # Redis: a fetched message whose worker is gone (no heartbeat for this long) goes back to its queue.
    "redeliver_after": {"realtime": 5, "batch": 10, "offline": 10},
    # Redis: a capped publish returns once this many replicas have it (WAIT); 1 with Sentinel loses none at failover.
    "wait_replicas": 0,
    # RabbitMQ: "classic" or "quorum" (replicated) tier, front-lane, sub-queue and dead-letter queues.
    # None: Celery's task_default_queue_type.
    "queue_type": None,
    # RabbitMQ: how a worker fetches from its tier queues and front lanes. "get": one basic_get per task,
    # nothing held that another worker could run. "consume": pushed by standing consumers (prefetch 1
    # each), at most one message in hand per such queue, for at most hold_max seconds, then given back.
    "fetch": "get",
    "hold_max": 0.1,
    "trace_max": 100_000,
    "sjf": True,
    "sjf_max_wait": 1.0,
    "max_length": {"realtime": 1000, "batch": 100_000, "offline": 1_000_000},
    "overflow": {"realtime": "reject", "batch": "reject", "offline": "drop_oldest"},
    "queue_prefix": "prio",
    "default_tier": "batch",
    "routes": {},
    "scheduler": "time",
    # What an idle tier's weight does: "proportional" (the busy tiers keep their ratio) or
    # "next_below" (it goes to the next busy tier below: quiet realtime speeds up batch).
    "idle_share": "proportional",
    "poll_interval": 0.05,
    "aging_interval": 1.0,
    "metrics_port": None,  # serve Prometheus /metrics from each worker on this port (off by default)
    "metrics_host": "127.0.0.1",
    # RabbitMQ management API for Retry-After (None: the broker's host, https on 15671 for amqps://)
    "management_url": None,
    # Send the broker's credentials to a management endpoint over plain HTTP off this host (refused by default).
    "management_plain_http": False,
}


def _per_tier(name: str, value: Any, default: Mapping[str, Any]) -> dict[Tier, Any]:
    """Merge a user's per-tier dict over the defaults, keyed by Tier."""
    merged = {parse_tier(k): v for k, v in default.items()}
    if value is None:
        return merged
    if not isinstance(value, Mapping):
        raise ConfigError(f"prio_{name} must be a dict keyed by tier (realtime/batch/offline), got {value!r}")
    for key, item in value.items():
        try:
            merged[parse_tier(key)] = item
        except ValueError as exc:
            raise ConfigError(f"prio_{name}: {exc}") from None
    return merged


def _number(name: str, value: Any, *, minimum: float, inclusive: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value >= minimum if inclusive else value > minimum
    if not ok:
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ConfigError(f"prio_{name} must be a number {bound}, got {value!r}")
    return float(value)


def _per_tier_numbers(
    name: str, raw: Mapping[str, Any], *, minimum: float, inclusive: bool = True
) -> dict[Tier, float]:
    """A per-tier setting whose every value is a number (``prio_<name>[<tier>]`` named in errors)."""
    return {
        t: _number(f"{name}[{t.label}]", v, minimum=minimum, inclusive=inclusive)
        for t, v in _per_tier(name, raw[name], DEFAULTS[name]).items()
    }


def _whole(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"prio_{name} must be a whole number >= 0, got {value!r}")
    return value


def _optional_positive_whole(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"prio_{name} must be a whole number >= 1 or None, got {value!r}")
    return value


def _optional_secret(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) < 16):
        raise ConfigError(f"prio_{name} must be a string of at least 16 characters or None")  # value not shown
    return value


def _optional_path(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"prio_{name} must be a file path or None, got {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"prio_{name} must be one of {choices}, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"prio_{name} must be True or False, got {value!r}")
    return value


def _queue_type(value: Any, conf: Mapping[str, Any]) -> str:
    source = "prio_queue_type"
    if value is None:
        value, source = conf.get("task_default_queue_type") or "classic", "task_default_queue_type"
    if value not in QUEUE_TYPES:
        raise ConfigError(f"{source} must be one of {QUEUE_TYPES}, got {value!r}")
    return value


def _caps(name: str, value: Any) -> dict[Tier, int | None]:
    caps: dict[Tier, int | None] = {}
    for t, v in _per_tier(name, value, DEFAULTS[name]).items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"prio_{name}[{t.label}] must be an int >= 1 or None, got {v!r}")
        caps[t] = v
    return caps


SUBQUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RESERVED_SUBQUEUES = ("promoted", "dlx")


def subqueue_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a sub-queue, or None."""
    if not isinstance(name, str) or not SUBQUEUE_NAME.fullmatch(name):
        return f"sub-queue name {name!r} must be 1-64 letters, digits, '_' or '-', starting with a letter or digit"
    if name in RESERVED_SUBQUEUES:
        return f"sub-queue name {name!r} is reserved ({', '.join(RESERVED_SUBQUEUES)})"
    return None


@dataclass(frozen=True)
class PrioSettings:
    weights: dict[Tier, float]
    reserve: int | None
    min_share: float
    aging: dict[Tier, float | None]
    realtime_target: float
    slice: dict[Tier, float | None]
    subqueue_weights: dict[Tier, dict[str, float]]
    subqueue_key: Any
    subqueue_max_length: dict[Tier, int | None]
    inherit: bool
    boost_timeout: float
    boost_memory: int
    boost_key: str | None
    boost_memory_bytes: int
    dead_letter_max: int | None
    prune_after: float
    demand_target: dict[Tier, float]
    trace_file: str | None
    redeliver_after: dict[Tier, float]
    wait_replicas: int
    queue_type: str
    fetch: str
    hold_max: float
    trace_max: int
    sjf: bool
    sjf_max_wait: float
    max_length: dict[Tier, int | None]
    overflow: dict[Tier, str]
    queue_prefix: str
    default_tier: Tier
    routes: tuple[tuple[str, Tier], ...]
    scheduler: str
    idle_share: str
    poll_interval: float
    aging_interval: float
    metrics_port: int | None
    metrics_host: str
    management_url: str | None
    management_plain_http: bool

    def queue_name(self, tier: Tier) -> str:
        return f"{self.queue_prefix}.{tier.label}"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.queue_prefix}.dead"

    @property
    def subqueue_registry(self) -> str:
        """Redis set of every sub-queue published to (workers discover sub-queues from it)."""
        return f"{self.queue_prefix}.subqueues"

    @property
    def subqueue_registry_version(self) -> str:
        """Redis counter bumped whenever a name joins the registry (the fetch script returns it)."""
        return f"{self.subqueue_registry}.version"

    @property
    def serving_key(self) -> str:
        """Redis hash: worker -> the tiers it serves (beside its heartbeat: a queue nobody serves is seen)."""
        return f"{self.queue_prefix}.serving"

    def presence_queue(self, tier: Tier) -> str:
        """RabbitMQ: the queue whose consumers are the workers serving ``tier`` (it never holds a message)."""
        return f"{self.queue_prefix}.serving.{tier.label}"

    @property
    def owners_key(self) -> str:
        """Redis hash: delivery tag -> the worker that fetched it (``worker|tier|fetched at``)."""
        return f"{self.queue_prefix}.owners"

    @property
    def heartbeats_key(self) -> str:
        """Redis hash: worker -> when it last said it is alive (Redis time)."""
        return f"{self.queue_prefix}.heartbeats"

    @property
    def stats_key(self) -> str:
        """Redis hash of broker-side counters (rejected/dropped per tier)."""
        return f"{self.queue_prefix}.stats"

    def tier_for_queue(self, name: str) -> Tier | None:
        """The tier a queue belongs to: a tier queue, its ``.promoted`` front lane, or one of its sub-queues."""
        name = name.removesuffix(PROMOTED_SUFFIX)
        for tier in TIERS:
            if name == self.queue_name(tier) or self.subqueue_of(name, tier) is not None:
                return tier
        return None

    def subqueue_name(self, tier: Tier, subqueue: str) -> str:
        return f"{self.queue_name(tier)}.{subqueue}"

    def is_subqueue(self, queue: Any) -> bool:
        """Whether ``queue`` names a sub-queue of one of this app's tiers (``<prefix>.<tier>.<name>``)."""
        tier = self.tier_for_queue(queue) if isinstance(queue, str) else None
        return tier is not None and self.subqueue_of(queue, tier) is not None

    def subqueue_of(self, queue: str, tier: Tier) -> str | None:
        """The sub-queue ``queue`` is in ``tier`` (``<prefix>.<tier>.<name>``), or None."""
        head = self.queue_name(tier) + "."
        if not queue.startswith(head):
            return None
        name = queue[len(head) :]
        return None if subqueue_name_problem(name) else name

    def sjf_subqueue(self, task_name: str) -> str:
        """The realtime sub-queue of a task name under shortest-job-first (``sjf-<name>``, a valid queue name)."""
        name = "sjf-" + re.sub(r"[^A-Za-z0-9_-]", "-", task_name)
        if len(name) > 64:  # long names: a prefix and a checksum of the whole
            name = f"{name[:55]}-{zlib.crc32(task_name.encode()):08x}"
        return name

    def sjf_queue(self, task_name: str) -> str:
        """The broker queue of a task name's shortest-first sub-queue."""
        return self.subqueue_name(Tier.REALTIME, self.sjf_subqueue(task_name))

    def subqueue_cap(self, tier: Tier) -> int | None:
        cap = self.subqueue_max_length[tier]
        return self.max_length[tier] if cap is None else cap

    def subqueue_weight(self, queue: str) -> float:
        tier = self.tier_for_queue(queue)
        sub = None if tier is None else self.subqueue_of(queue, tier)
        return 1.0 if sub is None else self.subqueue_weights[tier].get(sub, 1.0)

    def subqueue_for_call(self, name: str, args: Any, kwargs: Any, options: Any) -> Any:
        """``prio_subqueue_key`` applied to a call (the setting may name a function as ``module:function``)."""
        key = self.subqueue_key
        if key is None:
            return None
        if isinstance(key, str):
            module, _, attr = key.partition(":")
            try:
                key = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"prio_subqueue_key={self.subqueue_key!r} cannot be imported: {exc}") from None
        return key(name, args, kwargs, options)

    def front_lanes(self) -> dict[Tier, str]:
        """``<tier>.promoted``: the queue served before a tier's own, for tiers that need one.

        Aging promotes into it (oldest first, not behind the backlog a message
        already outwaited) and a sliced task that yielded resumes from it (a
        job keeps its turn in its tier: only higher tiers get in between).
        """
        tiers = {lower.promoted() for lower in TIERS if lower is not Tier.REALTIME and self.aging[lower] is not None}
        tiers |= {t for t in TIERS if self.slice[t] is not None}
        if self.inherit:  # celery_prio.boost lifts a queued task into realtime's or batch's front lane
            tiers |= {Tier.REALTIME, Tier.BATCH}
        return {t: self.queue_name(t) + PROMOTED_SUFFIX for t in TIERS if t in tiers}

    def tier_for_task_name(self, name: str) -> Tier | None:
        for pattern, tier in self.routes:
            if fnmatch.fnmatchcase(name, pattern):
                return tier
        return None

    def effective_reserve(self, concurrency: int) -> int:
        """Slots batch/offline may never occupy; checked against the pool size."""
        if self.reserve is None:
            return 1 if concurrency >= 2 else 0
        if concurrency and self.reserve >= concurrency:
            raise ConfigError(
                f"prio_reserve={self.reserve} must be below the worker concurrency "
                f"({concurrency}), or batch and offline tasks could never run"
            )
        return self.reserve


SETTING_NAMES = tuple(DEFAULTS)


def _config_keys(conf: Mapping[str, Any]) -> list[Any]:
    """Every key a Celery config holds (its changes and defaults), or a plain mapping's keys."""
    try:
        return list(conf.keys())
    except Exception:
        return []


def _misspelt_setting(key: Any, value: Any) -> bool:
    """A ``prio_`` key that is no setting. A function or module of that name (a config module's helper) is none."""
    if not isinstance(key, str) or not key.lower().startswith("prio_") or key.lower()[5:] in DEFAULTS:
        return False
    return not callable(value) and not isinstance(value, types.ModuleType)


def _unknown_setting(name: str) -> ConfigError:
    key = name.removeprefix("prio_")
    close = difflib.get_close_matches(key, SETTING_NAMES, n=1)
    hint = f"did you mean 'prio_{close[0]}'? " if close else ""
    return ConfigError(f"unknown celery-prio setting {name!r}; {hint}known settings: {', '.join(SETTING_NAMES)}")


def load_settings(conf: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> PrioSettings:
    """Read ``prio_*`` keys from a Celery config (plus ``install()`` overrides).

    A ``prio_`` key that is not a setting is refused with the nearest valid
    name: a misspelt cap or threshold must not silently fall back to its default.
    """
    for key in _config_keys(conf):
        if _misspelt_setting(key, conf.get(key)):
            raise _unknown_setting(key)
    raw = dict(DEFAULTS)
    for name in DEFAULTS:
        value = conf.get(f"prio_{name}")
        if value is not None:
            raw[name] = value
    for name, value in (overrides or {}).items():
        key = name.removeprefix("prio_")
        if key not in DEFAULTS:
            raise _unknown_setting(name)
        raw[key] = value

    weights = {
        t: _number("weights", w, minimum=0, inclusive=False)
        for t, w in _per_tier("weights", raw["weights"], DEFAULTS["weights"]).items()
    }
    reserve = raw["reserve"]
    if reserve is not None and (not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0):
        raise ConfigError(f"prio_reserve must be a whole number >= 0 or None, got {reserve!r}")
    min_share = _number("min_share", raw["min_share"], minimum=0)
    if min_share > 100:
        raise ConfigError(f"prio_min_share is a percentage (0..100), got {min_share!r}")

    aging: dict[Tier, float | None] = {}
    for t, v in _per_tier("aging", raw["aging"], DEFAULTS["aging"]).items():
        seconds = None if v is None else _number(f"aging[{t.label}]", v, minimum=0)
        aging[t] = None if t is Tier.REALTIME else seconds  # realtime has no tier above it

    realtime_target = _number("realtime_target", raw["realtime_target"], minimum=0, inclusive=False)
    slices: dict[Tier, float | None] = {}
    for t, v in _per_tier("slice", raw["slice"], derived_slices(realtime_target)).items():
        if t is Tier.REALTIME and v is not None:
            raise ConfigError(f"prio_slice[realtime] must be None: realtime never yields its slot, got {v!r}")
        slices[t] = None if v is None else _number(f"slice[{t.label}]", v, minimum=0, inclusive=False)

    max_length = _caps("max_length", raw["max_length"])
    subqueue_max_length = _caps("subqueue_max_length", raw["subqueue_max_length"])
    subqueue_weights: dict[Tier, dict[str, float]] = {t: {} for t in TIERS}
    for t, per_tier in _per_tier("subqueue_weights", raw["subqueue_weights"], {}).items():
        if not isinstance(per_tier, Mapping):
            raise ConfigError(
                f"prio_subqueue_weights[{t.label}] must be a dict of sub-queue -> weight, got {per_tier!r}"
            )
        for name, weight in per_tier.items():
            problem = subqueue_name_problem(name)
            if problem:
                raise ConfigError(f"prio_subqueue_weights[{t.label}]: {problem}")
            subqueue_weights[t][name] = _number(
                f"subqueue_weights[{t.label}][{name}]", weight, minimum=0, inclusive=False
            )
    subqueue_key = raw["subqueue_key"]
    named = isinstance(subqueue_key, str) and subqueue_key.count(":") == 1
    if subqueue_key is not None and not callable(subqueue_key) and not named:
        raise ConfigError(
            f"prio_subqueue_key must be a callable (task_name, args, kwargs, options) -> sub-queue, or "
            f"'module:function' naming one, got {subqueue_key!r}"
        )

    overflow = _per_tier("overflow", raw["overflow"], DEFAULTS["overflow"])
    for t, v in overflow.items():
        if v not in OVERFLOW_POLICIES:
            raise ConfigError(f"prio_overflow[{t.label}] must be one of {OVERFLOW_POLICIES}, got {v!r}")

    prefix = raw["queue_prefix"]
    if not isinstance(prefix, str) or not prefix or any(c.isspace() for c in prefix):
        raise ConfigError(f"prio_queue_prefix must be a non-empty string without spaces, got {prefix!r}")

    try:
        default_tier = parse_tier(raw["default_tier"])
    except ValueError as exc:
        raise ConfigError(f"prio_default_tier: {exc}") from None

    routes_raw = raw["routes"]
    if not isinstance(routes_raw, Mapping):
        raise ConfigError(f"prio_routes must be a dict of task-name pattern -> tier, got {routes_raw!r}")
    routes = []
    for pattern, tier in routes_raw.items():
        try:
            routes.append((str(pattern), parse_tier(tier)))
        except ValueError as exc:
            raise ConfigError(f"prio_routes[{pattern!r}]: {exc}") from None

    port = raw["metrics_port"]
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
        raise ConfigError(f"prio_metrics_port must be a TCP port (0..65535) or None, got {port!r}")
    if not isinstance(raw["metrics_host"], str) or not raw["metrics_host"]:
        raise ConfigError(f"prio_metrics_host must be a host name or address, got {raw['metrics_host']!r}")

    management_url = raw["management_url"]
    if management_url is not None and (
        not isinstance(management_url, str)
        or not management_url.strip()
        or not all(u.strip().startswith(("http://", "https://")) for u in management_url.split(";") if u.strip())
    ):
        raise ConfigError(
            f"prio_management_url must be an http:// or https:// URL (several, ';'-separated, for a cluster) "
            f"or None, got {management_url!r}"
        )

    queue_type = _queue_type(raw["queue_type"], conf)
    fetch = _choice("fetch", raw["fetch"], FETCH_MODES)
    if fetch == "consume" and queue_type == "quorum":
        raise ConfigError(
            "prio_fetch='consume' needs classic queues: it gives a message held past prio_hold_max back with "
            "basic_reject, and a quorum queue counts each give-back toward its delivery limit (RabbitMQ 4: 20, "
            "then the message is dead-lettered). Use prio_fetch='get' with prio_queue_type='quorum'."
        )

    return PrioSettings(
        weights=weights,
        reserve=reserve,
        min_share=min_share,
        aging=aging,
        realtime_target=realtime_target,
        slice=slices,
        subqueue_weights=subqueue_weights,
        subqueue_key=subqueue_key,
        subqueue_max_length=subqueue_max_length,
        inherit=_flag("inherit", raw["inherit"]),
        boost_timeout=_number("boost_timeout", raw["boost_timeout"], minimum=0, inclusive=False),
        boost_memory=_whole("boost_memory", raw["boost_memory"]),
        boost_key=_optional_secret("boost_key", raw["boost_key"]),
        boost_memory_bytes=_whole("boost_memory_bytes", raw["boost_memory_bytes"]),
        dead_letter_max=_optional_positive_whole("dead_letter_max", raw["dead_letter_max"]),
        prune_after=_number("prune_after", raw["prune_after"], minimum=60),
        trace_file=_optional_path("trace_file", raw["trace_file"]),
        wait_replicas=_whole("wait_replicas", raw["wait_replicas"]),
        queue_type=queue_type,
        fetch=fetch,
        hold_max=_number("hold_max", raw["hold_max"], minimum=0, inclusive=False),
        redeliver_after=_per_tier_numbers("redeliver_after", raw, minimum=MIN_REDELIVER_AFTER),
        trace_max=_whole("trace_max", raw["trace_max"]),
        demand_target=_per_tier_numbers("demand_target", raw, minimum=0, inclusive=False),
        sjf=_flag("sjf", raw["sjf"]),
        sjf_max_wait=_number("sjf_max_wait", raw["sjf_max_wait"], minimum=0, inclusive=False),
        max_length=max_length,
        overflow=overflow,
        queue_prefix=prefix,
        default_tier=default_tier,
        routes=tuple(routes),
        scheduler=_choice("scheduler", raw["scheduler"], SCHEDULER_MODES),
        idle_share=_choice("idle_share", raw["idle_share"], IDLE_SHARE_RULES),
        poll_interval=_number("poll_interval", raw["poll_interval"], minimum=0, inclusive=False),
        aging_interval=_number("aging_interval", raw["aging_interval"], minimum=0, inclusive=False),
        metrics_port=port,
        metrics_host=raw["metrics_host"],
        management_url=management_url,
        management_plain_http=_flag("management_plain_http", raw["management_plain_http"]),
    )


def settings_for(app: Any) -> PrioSettings:
    """The validated settings of an app (``install()`` keeps them; a worker re-reads ``app.conf``)."""
    cached = getattr(app, "_celery_prio_settings", None)
    if cached is None:
        cached = load_settings(app.conf)
        app._celery_prio_settings = cached
    return cached


def documented_settings() -> list[str]:
    """Setting names as users write them; the README test compares against this."""
    return [f"prio_{f.name}" for f in fields(PrioSettings)]
