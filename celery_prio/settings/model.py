"""``PrioSettings``: the parsed settings, and the rules that follow from them alone."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from ..errors import ConfigError
from ..headers import PROMOTED_SUFFIX
from ..tiers import TIERS, Tier
from .naming import QueueNames

#: ``prio_subqueue_key``: ``(task name, args, kwargs, options)`` to the call's sub-queue name, or None.
SubqueueKey = Callable[[str, Sequence[object], Mapping[str, object], Mapping[str, object]], object]


@dataclass(frozen=True)
class PrioSettings(QueueNames):
    """Every ``prio_*`` setting, validated and parsed (per-tier ones keyed by :class:`Tier`)."""

    weights: dict[Tier, float]
    reserve: int | None
    min_share: float
    aging: dict[Tier, float | None]
    realtime_target: float
    max_wait: dict[Tier, float | None]  # predicted-wait budget per tier (None: admitted by cap alone)
    realtime_deadline: float  # seconds after its publish a realtime call is not run (0: never)
    slice: dict[Tier, float | None]
    subqueue_weights: dict[Tier, dict[str, float]]
    subqueue_key: SubqueueKey | str | None  # a function, or its ``module:function`` name
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
    legacy_queues: tuple[str, ...] | None
    scheduler: str
    idle_share: str
    poll_interval: float
    gpus: tuple[str, ...]
    aging_interval: float
    metrics_port: int | None
    metrics_host: str
    management_url: str | None
    management_plain_http: bool

    def subqueue_cap(self, tier: Tier) -> int | None:
        cap = self.subqueue_max_length[tier]
        return self.max_length[tier] if cap is None else cap

    def subqueue_weight(self, queue: str) -> float:
        tier = self.tier_for_queue(queue)
        if tier is None:
            return 1.0
        sub = self.subqueue_of(queue, tier)
        return 1.0 if sub is None else self.subqueue_weights[tier].get(sub, 1.0)

    def subqueue_for_call(
        self, name: str, args: Sequence[object], kwargs: Mapping[str, object], options: Mapping[str, object]
    ) -> object:
        """``prio_subqueue_key`` applied to a call (the setting may name a function as ``module:function``)."""
        key = self.subqueue_key
        if key is None:
            return None
        if isinstance(key, str):
            module, _, attr = key.partition(":")
            try:
                key = cast(SubqueueKey, getattr(importlib.import_module(module), attr))
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
