"""The three tiers and the one function that turns user input into a tier."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """A scheduling class. Lower value = more urgent."""

    REALTIME = 0
    BATCH = 1
    OFFLINE = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    def promoted(self) -> Tier:
        """The tier one step up (realtime stays realtime)."""
        return Tier(max(self.value - 1, 0))


TIERS: tuple[Tier, ...] = (Tier.REALTIME, Tier.BATCH, Tier.OFFLINE)
"""Every tier, most urgent first: realtime (P0), batch (P1), offline (P2)."""

_ALIASES: dict[object, Tier] = {}
for _tier in TIERS:
    _ALIASES[_tier.label] = _tier
    _ALIASES[f"p{_tier.value}"] = _tier
    _ALIASES[str(_tier.value)] = _tier

#: What a user may name a tier by: a ``Tier``, ``"realtime"``/``"p0"``/``"0"``, or ``0`` (the same for batch, offline).
TierName = Tier | str | int

VALID_TIER_NAMES = "realtime|batch|offline (or p0|p1|p2, 0|1|2)"


def parse_tier(value: object, *, what: str = "tier") -> Tier:
    """Accept "realtime"/"p0"/0 (and the same for batch, offline).

    Anything else raises ValueError naming the valid tiers, so a typo in a
    task decorator or a call fails before anything is published.
    """
    if isinstance(value, Tier):
        return value
    if isinstance(value, bool):  # bool is an int; True is not a tier
        raise ValueError(f"unknown {what} {value!r}; valid tiers: {VALID_TIER_NAMES}")
    key = str(value).strip().lower() if isinstance(value, (str, int)) else None
    tier = _ALIASES.get(key)
    if tier is None:
        raise ValueError(f"unknown {what} {value!r}; valid tiers: {VALID_TIER_NAMES}")
    return tier
