"""What a worker requires of the Redis server it runs against."""

from __future__ import annotations

from ...errors import ConfigError

#: The oldest Redis server the worker runs against: ``ZRANGE ... BYSCORE`` (kombu's restore, here) is 6.2's,
#: and a doorbell wait's timeout in fractions of a second (``BLPOP``) 6.0's.
MIN_REDIS = (6, 2)


def check_server_version(version: object) -> None:
    """``ConfigError`` naming the version found, on a server older than :data:`MIN_REDIS`."""
    try:
        found = tuple(int(x) for x in str(version).split(".")[:2])
    except ValueError:
        return  # a fork that reports something else: let it try
    if found < MIN_REDIS:
        raise ConfigError(
            f"celery-prio needs Redis {'.'.join(map(str, MIN_REDIS))} or newer (ZRANGE BYSCORE, BLPOP with a "
            f"fractional timeout); the broker runs Redis {version}"
        )
