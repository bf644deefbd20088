"""Errors raised by celery-prio to callers and operators."""

from __future__ import annotations

from .tiers import Tier


class ConfigError(ValueError):
    """A ``prio_*`` setting has a bad value; the message names the setting and the value."""


class QueueFull(Exception):
    """A tier refused a publish because it is at its maximum length.

    Carries what an HTTP front door needs to answer ``429 Too Many Requests``
    with a ``Retry-After`` header, so the caller can degrade instead of wait.
    """

    status_code = 429
    #: Seconds suggested when no drain rate is known yet (no worker reported one).
    default_retry_after = 1.0

    #: Why the publish was refused: ``"cap"`` (the tier holds ``prio_max_length``) or ``"wait"`` (the call's
    #: predicted wait is over the tier's ``prio_max_wait``).
    reason = "cap"
    #: For ``"wait"``: the predicted wait and the budget it was over, in seconds.
    predicted_wait: float | None = None
    budget: float | None = None

    def __init__(self, tier: Tier, waiting: int | None, retry_after: float) -> None:
        self.tier = tier
        self.waiting = waiting
        self.retry_after = max(0.0, float(retry_after))
        count = "" if waiting is None else f" ({waiting} waiting)"
        super().__init__(f"{tier.label} tier is full{count}; retry after {self.retry_after:.1f} s")

    @classmethod
    def over_budget(cls, tier: Tier, waiting: int | None, predicted: float, budget: float) -> QueueFull:
        """Refused for its predicted wait: retry once the work ahead is back within the budget."""
        full = cls(tier, waiting, max(predicted - budget, 0.001))
        full.reason, full.predicted_wait, full.budget = "wait", predicted, budget
        full.args = (
            f"{tier.label} tier refused the call: predicted wait {predicted:.2f} s over the {budget:g} s budget "
            f"(prio_max_wait); retry after {full.retry_after:.2f} s",
        )
        return full

    @classmethod
    def from_drain_rate(cls, tier: Tier, waiting: int | None, rate: float) -> QueueFull:
        """Retry after the time one message takes to leave a tier draining at ``rate`` per second."""
        return cls(tier, waiting, 1.0 / rate if rate > 0 else cls.default_retry_after)
