"""An idle Redis worker blocks on its tiers' doorbells instead of polling its queues.

Every publish into a tier rings the tier's bell (``lua/ring.lua``: a token
pushed onto ``<prefix>.bell.<tier>``, at most ``BELL_MAX`` kept). A worker
with a free slot whose fetch found every asked queue empty sends ``BLPOP`` on
the bells of those tiers, on a connection of its own, and registers the
socket with the worker's event loop: no thread, no timer, no poll. Redis
hands one token to the longest-waiting worker, so one message wakes one
worker, and that worker then fetches through the scheduler's order as
always (a tier that rang first is not served first for it). The block ends
after ``BELL_TIMEOUT`` seconds with no token; the worker then asks whether
any of its queues holds anything (one round trip: the ready index, and
``EXISTS`` over the lists it does not cover; the safety net for the rare
paths that ring no bell, a writer that does not know them) and fetches only
if one does, else blocks again.

A token that reaches a worker which has meanwhile filled its slots goes back
onto its bell, so another idle worker is woken in its place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...settings import PrioSettings
from ...tiers import Tier
from .scripts import BELL_MAX

if TYPE_CHECKING:
    from kombu.asynchronous import Hub
    from redis import ConnectionPool, Redis
    from redis.connection import Connection as RedisConnection

logger = logging.getLogger(__name__)

#: Seconds an idle worker blocks on its bells before it fetches once anyway.
BELL_TIMEOUT = 1.0
_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
#: Error replies a wait can get, none of which may end the worker (Celery takes a ResponseError raised in its
#: event loop for an unrecoverable one): ``-UNBLOCKED`` when the server becomes a replica (a failover,
#: ``REPLICAOF``), ``-READONLY`` on a replica, ``-OOM`` under ``noeviction``, ``-BUSY`` during a long script,
#: ``-NOPERM`` from an ACL. The worker polls instead for ``REPLY_ERROR_PAUSE`` seconds, then tries again.
_REPLY_ERRORS = (ResponseError,)
REPLY_ERROR_PAUSE = 1.0


class Doorbell:
    """One worker's wait on its tiers' bells (``hub``: the worker's kombu event loop)."""

    def __init__(
        self,
        make_client: Callable[[], Redis],
        settings: PrioSettings,
        hub: Hub,
        on_ring: Callable[[], None],
        free_slots: Callable[[], int],
        anything_waiting: Callable[[Redis, list[Tier]], bool],
    ) -> None:
        self.make_client = make_client
        self.anything_waiting = anything_waiting  # whether a list the worker serves in these tiers holds work
        self.settings = settings
        self.hub = hub
        self.on_ring = on_ring
        self.free_slots = free_slots
        self._client: Redis | None = None
        self._connection: RedisConnection | None = None  # the connection a BLPOP is out on, while it is
        self._tiers: frozenset[Tier] = frozenset()
        self._unblocked = False
        self._failing: str | None = None  # the error reply that made this worker poll instead, while it does
        self._retry_at = 0.0  # monotonic time before which a wait is not tried again after an error reply
        self.waits = 0  # BLPOPs sent (reported; bounded by arrivals plus one a second while idle)
        self.rung = 0  # tokens received
        self.passed_on = 0  # tokens put back for another worker (this one had no free slot)

    @property
    def waiting(self) -> bool:
        return self._connection is not None

    def quiet_tiers(self) -> frozenset[Tier]:
        """Tiers known to be empty: a wait on their bells is out and no token has come back.

        Every publish into a tier rings its bell, so until the reply is read their queues hold nothing
        (the rare paths that ring no bell are what the safety net at each timeout is for). A reply already
        in the socket is read on the loop's next turn, and the fetch it triggers asks them again."""
        return self._tiers if self._connection is not None and not self._unblocked else frozenset()

    def wait(self, tiers: list[Tier]) -> bool:
        """Block on ``tiers``' bells until a token arrives or ``BELL_TIMEOUT`` passes, then call ``on_ring``.
        False when it cannot (Redis unreachable): the caller polls instead."""
        if self._connection is not None:
            if not set(tiers) <= self._tiers:
                # A tier allowed since (a slot freed for batch): end this wait now (CLIENT UNBLOCK answers the
                # BLPOP with a timeout), and the fetch that follows waits on every tier it asked.
                self._unblock()
            return True
        if self._failing is not None and time.monotonic() < self._retry_at:
            return False  # an error reply a moment ago: poll for now
        connection = None
        try:
            if self._client is None:
                self._client = self.make_client()
            connection = _pool_connection(self._client.connection_pool)
            # Once per socket, to unblock it: a connection that reconnected (a Redis restart) has a new id, and
            # ids start again at 1 after a restart, so an old one could unblock another app's client.
            if getattr(connection, "prio_client_id", (None, None))[0] is not connection._sock:
                connection.send_command("CLIENT", "ID")
                connection.prio_client_id = (connection._sock, connection.read_response())
            connection.send_command("BLPOP", *(self.settings.bell_key(t) for t in tiers), BELL_TIMEOUT)
        except _REPLY_ERRORS as exc:
            self._replied_error(exc, connection)
            return False
        except _ERRORS as exc:
            logger.debug("celery-prio: cannot wait on the doorbells (%r); polling", exc)
            self.close()
            return False
        self._connection, self._tiers = connection, frozenset(tiers)
        self.hub.add_reader(connection._sock, self._rang)
        self.waits += 1
        return True

    def _replied_error(self, exc: Exception, connection: RedisConnection | None) -> None:
        """An error reply on the wait: never fatal. Poll for a moment, say so once, and try again after."""
        if self._failing is None:
            logger.warning(
                "celery-prio: waiting on the doorbells got an error reply (%s); this worker polls its queues "
                "until they answer again",
                exc,
            )
        self._failing, self._retry_at = repr(exc), time.monotonic() + REPLY_ERROR_PAUSE
        if connection is not None and self._client is not None:
            self._client.connection_pool.release(connection)  # the reply was read: the connection is sound

    def _anything_waiting(self, tiers: list[Tier]) -> bool:
        """Whether any list of ``tiers`` holds work, in one round trip (True when it cannot tell: fetch)."""
        try:
            return self.anything_waiting(self._client, tiers)
        except (*_ERRORS, *_REPLY_ERRORS):
            return True

    def _rang(self, *_: object) -> None:
        connection = self._connection
        if connection is None:
            return
        self.hub.remove_reader(connection._sock)
        self._connection = None
        try:
            reply = connection.read_response()
        except _REPLY_ERRORS as exc:
            self._replied_error(exc, connection)
            reply = None
        except _ERRORS as exc:
            logger.debug("celery-prio: the doorbell connection failed (%r)", exc)
            self.close()
            reply = None
        else:
            self._client.connection_pool.release(connection)
            if self._failing is not None:
                logger.warning("celery-prio: the doorbells answer again; idle workers block on them again")
                self._failing = None
        if reply is not None:
            self.rung += 1
            if self.free_slots() <= 0:  # filled meanwhile: the token wakes another idle worker instead
                self._pass_on(reply[0])
                return
        elif self._client is not None and not self._unblocked:
            tiers = list(self._tiers)
            if not self._anything_waiting(tiers) and self.wait(tiers):
                return  # timed out, and nothing waits anywhere: block again, the fetch loop sleeps on
        self._unblocked = False
        self.on_ring()

    def _unblock(self) -> None:
        self._unblocked = True  # answered as a timeout: the fetch loop must look, not block again
        try:
            self._client.client_unblock(self._connection.prio_client_id[1])
        except (*_ERRORS, *_REPLY_ERRORS):
            pass  # the wait ends at its timeout instead

    def _pass_on(self, bell: str) -> None:
        try:
            self._client.pipeline(transaction=False).lpush(bell, 1).ltrim(bell, 0, BELL_MAX - 1).execute()
            self.passed_on += 1
        except (*_ERRORS, *_REPLY_ERRORS):
            pass  # another idle worker finds the message at its own timeout

    def close(self) -> None:
        """Stop waiting and drop the connection (the worker stops, or its connection failed)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                self.hub.remove_reader(connection._sock)
            except Exception:  # the socket is gone already
                pass
        client, self._client = self._client, None
        if client is not None:
            try:
                client.connection_pool.disconnect()
            except Exception:
                pass


def _pool_connection(pool: ConnectionPool) -> RedisConnection:
    """A connection from ``pool``: redis-py 5.3 and newer take no command name (and warn about one), 5.0 to 5.2
    require it (a TypeError per wait, in a retry loop, on the oldest versions this package allows)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("BLPOP")
