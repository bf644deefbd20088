"""celery-prio: three-tier GPU-time scheduling for existing Celery apps.

    import celery_prio
    celery_prio.install(app)

Tasks keep calling ``.delay()``; pick a tier with ``@app.task(tier="realtime")``
or ``task.apply_async(..., tier="batch")``.
"""

from __future__ import annotations

from .batching import Batch, BatchResultError, Call
from .boost import Boost, boost, wait
from .errors import ConfigError, QueueFull
from .install import install
from .producer.bulk import BulkQueueFull, BulkResult, bulk
from .runtime import settings_for
from .slices import slices
from .tiers import TIERS, Tier, parse_tier

__all__ = [
    "TIERS",
    "Batch",
    "BatchResultError",
    "Boost",
    "BulkQueueFull",
    "BulkResult",
    "Call",
    "ConfigError",
    "QueueFull",
    "Tier",
    "boost",
    "bulk",
    "install",
    "parse_tier",
    "settings_for",
    "slices",
    "wait",
]
__version__ = "0.1.0"
