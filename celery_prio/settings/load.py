"""``load_settings``: read every ``prio_*`` key of a Celery config, validate it group by group.

Everything is validated once, at ``install()`` and again at worker start
(where the pool size is known), and every error names the setting and the
offending value. A ``prio_`` key that is not a setting is refused with the
nearest valid name: a misspelt cap or threshold must not silently fall back
to its default.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..errors import ConfigError
from ..tiers import TIERS, Tier, parse_tier
from . import checks
from .model import PrioSettings
from .naming import subqueue_name_problem
from .table import (
    DEADLINE_FACTOR,
    DEFAULTS,
    FETCH_MODES,
    IDLE_SHARE_RULES,
    MIN_REDELIVER_AFTER,
    OVERFLOW_POLICIES,
    SCHEDULER_MODES,
    SETTING_NAMES,
    derived_max_wait,
    derived_slices,
)

Raw = dict[str, object]


def _scheduling(raw: Raw, conf: Mapping[str, object]) -> dict[str, Any]:
    weights = {
        t: checks.number("weights", w, minimum=0, inclusive=False)
        for t, w in checks.per_tier("weights", raw["weights"], DEFAULTS["weights"]).items()
    }
    reserve = raw["reserve"]
    if reserve is not None and (not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0):
        raise ConfigError(f"prio_reserve must be a whole number >= 0 or None, got {reserve!r}")
    min_share = checks.number("min_share", raw["min_share"], minimum=0)
    if min_share > 100:
        raise ConfigError(f"prio_min_share is a percentage (0..100), got {min_share!r}")
    return {
        "weights": weights,
        "reserve": reserve,
        "min_share": min_share,
        "realtime_target": checks.number("realtime_target", raw["realtime_target"], minimum=0, inclusive=False),
        "scheduler": checks.choice("scheduler", raw["scheduler"], SCHEDULER_MODES),
        "idle_share": checks.choice("idle_share", raw["idle_share"], IDLE_SHARE_RULES),
        "poll_interval": checks.number("poll_interval", raw["poll_interval"], minimum=0, inclusive=False),
        "gpus": checks.gpus(raw["gpus"]),
    }


def _aging_and_slices(raw: Raw, realtime_target: float) -> dict[str, Any]:
    aging: dict[Tier, float | None] = {}
    for t, v in checks.per_tier("aging", raw["aging"], DEFAULTS["aging"]).items():
        seconds = None if v is None else checks.number(f"aging[{t.label}]", v, minimum=0)
        aging[t] = None if t is Tier.REALTIME else seconds  # realtime has no tier above it
    slices: dict[Tier, float | None] = {}
    for t, v in checks.per_tier("slice", raw["slice"], derived_slices(realtime_target)).items():
        if t is Tier.REALTIME and v is not None:
            raise ConfigError(f"prio_slice[realtime] must be None: realtime never yields its slot, got {v!r}")
        slices[t] = None if v is None else checks.number(f"slice[{t.label}]", v, minimum=0, inclusive=False)
    return {
        "aging": aging,
        "slice": slices,
        "aging_interval": checks.number("aging_interval", raw["aging_interval"], minimum=0, inclusive=False),
    }


def _capacity(raw: Raw, realtime_target: float) -> dict[str, Any]:
    max_wait: dict[Tier, float | None] = {}
    for t, v in checks.per_tier("max_wait", raw["max_wait"], derived_max_wait(realtime_target)).items():
        max_wait[t] = None if v is None else checks.number(f"max_wait[{t.label}]", v, minimum=0, inclusive=False)
    raw_deadline = raw["realtime_deadline"]
    deadline = (
        realtime_target * DEADLINE_FACTOR
        if raw_deadline is None
        else checks.number("realtime_deadline", raw_deadline, minimum=0)
    )
    overflow = checks.per_tier("overflow", raw["overflow"], DEFAULTS["overflow"])
    for t, v in overflow.items():
        if v not in OVERFLOW_POLICIES:
            raise ConfigError(f"prio_overflow[{t.label}] must be one of {OVERFLOW_POLICIES}, got {v!r}")
    return {
        "max_wait": max_wait,
        "realtime_deadline": deadline,
        "max_length": checks.caps("max_length", raw["max_length"]),
        "subqueue_max_length": checks.caps("subqueue_max_length", raw["subqueue_max_length"]),
        "overflow": overflow,
    }


def _subqueues(raw: Raw) -> dict[str, Any]:
    subqueue_weights: dict[Tier, dict[str, float]] = {t: {} for t in TIERS}
    for t, per_tier in checks.per_tier("subqueue_weights", raw["subqueue_weights"], {}).items():
        if not isinstance(per_tier, Mapping):
            raise ConfigError(
                f"prio_subqueue_weights[{t.label}] must be a dict of sub-queue -> weight, got {per_tier!r}"
            )
        for name, weight in per_tier.items():
            problem = subqueue_name_problem(name)
            if problem:
                raise ConfigError(f"prio_subqueue_weights[{t.label}]: {problem}")
            subqueue_weights[t][name] = checks.number(
                f"subqueue_weights[{t.label}][{name}]", weight, minimum=0, inclusive=False
            )
    subqueue_key = raw["subqueue_key"]
    named = isinstance(subqueue_key, str) and subqueue_key.count(":") == 1
    if subqueue_key is not None and not callable(subqueue_key) and not named:
        raise ConfigError(
            f"prio_subqueue_key must be a callable (task_name, args, kwargs, options) -> sub-queue, or "
            f"'module:function' naming one, got {subqueue_key!r}"
        )
    return {
        "subqueue_weights": subqueue_weights,
        "subqueue_key": subqueue_key,
        "sjf": checks.flag("sjf", raw["sjf"]),
        "sjf_max_wait": checks.number("sjf_max_wait", raw["sjf_max_wait"], minimum=0, inclusive=False),
    }


def _routing(raw: Raw) -> dict[str, Any]:
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
    legacy = raw["legacy_queues"]
    if legacy is not None:
        if isinstance(legacy, str):
            legacy = [legacy]
        if not isinstance(legacy, (list, tuple)) or not all(isinstance(q, str) and q.strip() for q in legacy):
            raise ConfigError(f"prio_legacy_queues must be a list of queue names, [] or None, got {legacy!r}")
        legacy = tuple(legacy)
    return {"queue_prefix": prefix, "default_tier": default_tier, "routes": tuple(routes), "legacy_queues": legacy}


def _observability(raw: Raw) -> dict[str, Any]:
    port = raw["metrics_port"]
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
        raise ConfigError(f"prio_metrics_port must be a TCP port (0..65535) or None, got {port!r}")
    if not isinstance(raw["metrics_host"], str) or not raw["metrics_host"]:
        raise ConfigError(f"prio_metrics_host must be a host name or address, got {raw['metrics_host']!r}")
    return {
        "metrics_port": port,
        "metrics_host": raw["metrics_host"],
        "demand_target": checks.per_tier_numbers("demand_target", raw, minimum=0, inclusive=False),
        "trace_file": checks.optional_path("trace_file", raw["trace_file"]),
        "trace_max": checks.whole("trace_max", raw["trace_max"]),
    }


def _rabbitmq(raw: Raw, conf: Mapping[str, object]) -> dict[str, Any]:
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
    queue_type = checks.queue_type(raw["queue_type"], conf)
    # Push by default; quorum queues poll (a message a worker gives back counts toward their delivery limit).
    default_fetch = "get" if queue_type == "quorum" else "consume"
    fetch = default_fetch if raw["fetch"] is None else checks.choice("fetch", raw["fetch"], FETCH_MODES)
    if fetch == "consume" and queue_type == "quorum":
        raise ConfigError(
            "prio_fetch='consume' needs classic queues: it gives a message held past prio_hold_max back with "
            "basic_reject, and a quorum queue counts each give-back toward its delivery limit (RabbitMQ 4: 20, "
            "then the message is dead-lettered). Use prio_fetch='get' with prio_queue_type='quorum'."
        )
    return {
        "management_url": management_url,
        "management_plain_http": checks.flag("management_plain_http", raw["management_plain_http"]),
        "queue_type": queue_type,
        "fetch": fetch,
        "hold_max": checks.number("hold_max", raw["hold_max"], minimum=0, inclusive=False),
    }


def _inheritance_and_bookkeeping(raw: Raw) -> dict[str, Any]:
    return {
        "inherit": checks.flag("inherit", raw["inherit"]),
        "boost_timeout": checks.number("boost_timeout", raw["boost_timeout"], minimum=0, inclusive=False),
        "boost_memory": checks.whole("boost_memory", raw["boost_memory"]),
        "boost_key": checks.optional_secret("boost_key", raw["boost_key"]),
        "boost_memory_bytes": checks.whole("boost_memory_bytes", raw["boost_memory_bytes"]),
        "dead_letter_max": checks.optional_positive_whole("dead_letter_max", raw["dead_letter_max"]),
        "prune_after": checks.number("prune_after", raw["prune_after"], minimum=60),
        "redeliver_after": checks.per_tier_numbers("redeliver_after", raw, minimum=MIN_REDELIVER_AFTER),
        "wait_replicas": checks.whole("wait_replicas", raw["wait_replicas"]),
    }


def load_settings(conf: Mapping[str, object], overrides: Mapping[str, object] | None = None) -> PrioSettings:
    """Read ``prio_*`` keys from a Celery config (plus ``install()`` overrides)."""
    raw = _raw_values(conf, overrides)
    values = _scheduling(raw, conf)
    values |= _aging_and_slices(raw, values["realtime_target"])
    values |= _capacity(raw, values["realtime_target"])
    values |= _subqueues(raw)
    values |= _routing(raw)
    values |= _observability(raw)
    values |= _rabbitmq(raw, conf)
    values |= _inheritance_and_bookkeeping(raw)
    return PrioSettings(**values)


def _raw_values(conf: Mapping[str, object], overrides: Mapping[str, object] | None) -> Raw:
    """The defaults, with the config's ``prio_*`` keys over them and ``overrides`` over those."""
    # ``config_from_object(..., namespace="CELERY")``: settings are written CELERY_PRIO_MAX_LENGTH.
    prefix = getattr(conf, "__dict__", {}).get("prefix")  # Celery keeps it there; attribute access reads a key
    for key in _config_keys(conf):
        bare = key[len(prefix) :] if isinstance(prefix, str) and key.upper().startswith(prefix.upper()) else key
        if _misspelt_setting(bare, conf.get(key)):
            raise _unknown_setting(bare.lower(), shown=key)
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
    return raw


def _config_keys(conf: Mapping[str, object]) -> list[str]:
    """Every key a Celery config holds (its changes and defaults), or a plain mapping's keys."""
    try:
        keys = list(conf.keys())  # a Celery config's keys() covers its changes and its defaults
        return [key for key in keys if isinstance(key, str)]
    except Exception:
        return []


def _misspelt_setting(key: str, value: object) -> bool:
    """A ``prio_`` key that is no setting. A function or module of that name (a config module's helper) is none."""
    if not key.lower().startswith("prio_") or key.lower()[5:] in DEFAULTS:
        return False
    return not callable(value) and not isinstance(value, types.ModuleType)


def _unknown_setting(name: str, shown: str | None = None) -> ConfigError:
    """``shown``: the key as the config spells it (``CELERY_PRIO_MAX_LENGHT`` under a namespace)."""
    key = name.removeprefix("prio_")
    close = difflib.get_close_matches(key, SETTING_NAMES, n=1)
    hint = ""
    if close:
        spelled = f"prio_{close[0]}"
        if shown is not None and shown.lower() != name.lower():
            spelled = shown[: len(shown) - len(name)] + spelled.upper()
        hint = f"did you mean {spelled!r}? "
    return ConfigError(
        f"unknown celery-prio setting {shown or name!r}; {hint}known settings: {', '.join(SETTING_NAMES)}"
    )


def documented_settings() -> list[str]:
    """Setting names as users write them (``prio_<name>``), in the table's order."""
    return [f"prio_{f.name}" for f in fields(PrioSettings)]
