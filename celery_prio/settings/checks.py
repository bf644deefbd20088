"""Checks for ``prio_*`` values: each returns the value in its parsed form or raises ``ConfigError``
naming the setting and the value. Per-tier settings accept a dict keyed by any tier alias."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import ConfigError
from ..tiers import Tier, parse_tier
from .table import DEFAULTS, QUEUE_TYPES


def per_tier(name: str, value: object, default: object) -> dict[Tier, object]:
    """Merge a user's per-tier dict over the defaults (a mapping of tier names), keyed by Tier."""
    if not isinstance(default, Mapping):
        raise TypeError(f"the default of prio_{name} is not per tier: {default!r}")
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


def number(name: str, value: object, *, minimum: float, inclusive: bool = True) -> float:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if finite and isinstance(value, (int, float)) and (value >= minimum if inclusive else value > minimum):
        return float(value)
    bound = f">= {minimum}" if inclusive else f"> {minimum}"
    raise ConfigError(f"prio_{name} must be a number {bound}, got {value!r}")


def per_tier_numbers(
    name: str, raw: Mapping[str, object], *, minimum: float, inclusive: bool = True
) -> dict[Tier, float]:
    """A per-tier setting whose every value is a number (``prio_<name>[<tier>]`` named in errors)."""
    return {
        t: number(f"{name}[{t.label}]", v, minimum=minimum, inclusive=inclusive)
        for t, v in per_tier(name, raw[name], DEFAULTS[name]).items()
    }


def whole(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"prio_{name} must be a whole number >= 0, got {value!r}")
    return value


def optional_positive_whole(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"prio_{name} must be a whole number >= 1 or None, got {value!r}")
    return value


def optional_secret(name: str, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) < 16):
        raise ConfigError(f"prio_{name} must be a string of at least 16 characters or None")  # value not shown
    return value


def optional_path(name: str, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"prio_{name} must be a file path or None, got {value!r}")
    return value


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"prio_{name} must be one of {choices}, got {value!r}")
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"prio_{name} must be True or False, got {value!r}")
    return value


def queue_type(value: object, conf: Mapping[str, object]) -> str:
    source = "prio_queue_type"
    if value is None:
        value, source = conf.get("task_default_queue_type") or "classic", "task_default_queue_type"
    if not isinstance(value, str) or value not in QUEUE_TYPES:
        raise ConfigError(f"{source} must be one of {QUEUE_TYPES}, got {value!r}")
    return value


def caps(name: str, value: object) -> dict[Tier, int | None]:
    caps: dict[Tier, int | None] = {}
    for t, v in per_tier(name, value, DEFAULTS[name]).items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"prio_{name}[{t.label}] must be an int >= 1 or None, got {v!r}")
        caps[t] = v
    return caps


def gpus(value: object) -> tuple[str, ...]:
    """``prio_gpus``: None, ``"0,1"`` or ``[0, 1]``; the GPU numbers as strings."""
    if value is None or value == "" or value == []:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    out = tuple(str(g).strip() for g in items or () if str(g).strip())
    if items is None or not out or not all(g.isdigit() for g in out):
        raise ConfigError(f"--prio-gpus, prio_gpus and CELERY_PRIO_GPUS take GPU numbers like 0,1; got {value!r}")
    return out
