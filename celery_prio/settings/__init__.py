"""``prio_*`` settings: the table of every setting (``table``), the checks (``checks``), loading by
group (``load``), the parsed form (``model``) and the naming scheme it carries (``naming``)."""

from __future__ import annotations

from .load import documented_settings, load_settings
from .model import PrioSettings
from .naming import RESERVED_SUBQUEUES, SUBQUEUE_NAME, subqueue_name_problem
from .table import (
    DEFAULTS,
    FETCH_MODES,
    IDLE_SHARE_RULES,
    MIN_REDELIVER_AFTER,
    OVERFLOW_POLICIES,
    QUEUE_TYPES,
    SCHEDULER_MODES,
    SETTING_NAMES,
    SETTINGS,
    SLICE_FRACTION,
    Setting,
    derived_slices,
)

__all__ = [
    "DEFAULTS",
    "FETCH_MODES",
    "IDLE_SHARE_RULES",
    "MIN_REDELIVER_AFTER",
    "OVERFLOW_POLICIES",
    "QUEUE_TYPES",
    "RESERVED_SUBQUEUES",
    "SCHEDULER_MODES",
    "SETTINGS",
    "SETTING_NAMES",
    "SLICE_FRACTION",
    "SUBQUEUE_NAME",
    "PrioSettings",
    "Setting",
    "derived_slices",
    "documented_settings",
    "load_settings",
    "subqueue_name_problem",
]
