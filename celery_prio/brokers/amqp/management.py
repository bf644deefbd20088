"""The RabbitMQ management API, for the drain rate behind ``QueueFull.retry_after``.

Where it is: ``prio_management_url`` when set (``https://user:pass@host:15671``),
else the broker's host over HTTPS on 15671 when the broker URL is ``amqps://``
and over HTTP on 15672 otherwise. Credentials come from that URL, or from the
broker URL when it names them; never from a default (no guest fallback), and
never over plain HTTP to a broker reached over TLS. A cluster has one API per
node, each answering for the whole cluster: a ``;``-separated
``prio_management_url``, or a broker URL with failover hosts, gives several,
tried in turn (the next one when the one in use stops answering).

One client per (URL, credentials) in a process, one kept-alive connection,
and a short cache: a burst of refusals costs one request per queue per
``CACHE_SECONDS``, not one each.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
import urllib.parse
from base64 import b64encode
from typing import TYPE_CHECKING, Any

from kombu.utils.url import url_to_parts

from ...settings import PrioSettings
from ...tiers import TIERS

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

CACHE_SECONDS = 1.0
TIMEOUT_SECONDS = 0.3


class ManagementClient:
    def __init__(self, base_url: str, vhost: str, auths: tuple[tuple[str, str] | None, ...] | None) -> None:
        """``base_url``: one endpoint, or several separated by ``;`` (a cluster's nodes); ``auths``: the
        credentials of each (None: send none)."""
        self.endpoints = [_endpoint(url.strip()) for url in base_url.split(";") if url.strip()]
        self._current = 0
        self.vhost = vhost
        self._headers = []
        for auth in auths or [None] * len(self.endpoints):
            headers = {"Accept": "application/json"}
            if auth is not None:
                headers["Authorization"] = "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            self._headers.append(headers)
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, float]] = {}
        self.requests = 0  # tests and benchmarks read it

    @property
    def path(self) -> str:
        return self.endpoints[self._current][3]

    @property
    def headers(self) -> dict[str, str]:
        """The request headers of the endpoint in use (its own credentials)."""
        return self._headers[self._current]

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            https, host, port, _ = self.endpoints[self._current]
            cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
            self._conn = cls(host, port, timeout=TIMEOUT_SECONDS)
        return self._conn

    def drain_rate(self, queue: str) -> float:
        """Messages/s delivered from ``queue`` lately (0.0 when unknown or unreachable)."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(queue)
            if cached is not None and now - cached[0] < CACHE_SECONDS:
                return cached[1]
            rate = self._fetch_rate(queue)
            self._cache[queue] = (now, rate)
            return rate

    def list_queues(
        self, pattern: str, page_size: int = 500, max_pages: int = 20
    ) -> list[tuple[str, int | None]] | None:
        """``(name, messages ready or None)`` of the vhost's queues matching ``pattern``; None if unreachable."""
        with self._lock:
            return self._list_queues(pattern, page_size, max_pages)

    def _list_queues(self, pattern: str, page_size: int, max_pages: int) -> list[tuple[str, int | None]] | None:
        out: list[tuple[str, int | None]] = []
        vhost = urllib.parse.quote(self.vhost, safe="")
        for page in range(1, max_pages + 1):
            query = urllib.parse.urlencode(
                {
                    "page": page,
                    "page_size": page_size,
                    "name": pattern,
                    "use_regex": "true",
                    "columns": "name,messages_ready",
                }
            )
            data = self._get_json(f"/api/queues/{vhost}?{query}")
            if not isinstance(data, dict) or not isinstance(data.get("items"), list):
                return None
            for item in data["items"]:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    ready = item.get("messages_ready")
                    out.append((item["name"], ready if isinstance(ready, int) else None))
            if page >= int(data.get("page_count") or 1):
                break
        return out

    def _get_json(self, path: str) -> object:
        """The decoded JSON body of a GET (None for any failure or a status other than 200). Caller holds the lock.

        ``path`` is relative to the endpoint's own path. A kept-alive
        connection the server closed is reopened once; an endpoint that does
        not answer gives way to the next.
        """
        for attempt in range(len(self.endpoints) + 1):
            try:
                conn = self._connection()
                self.requests += 1
                conn.request("GET", self.path + path, headers=self.headers)
                response = conn.getresponse()
                body = response.read()
                return json.loads(body) if response.status == 200 else None
            except (OSError, http.client.HTTPException, ValueError):
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if attempt:  # the first retry is the same endpoint (a closed keep-alive), then the others
                    self._current = (self._current + 1) % len(self.endpoints)
        return None

    def _fetch_rate(self, queue: str) -> float:
        vhost, name = urllib.parse.quote(self.vhost, safe=""), urllib.parse.quote(queue, safe="")
        data = self._get_json(f"/api/queues/{vhost}/{name}")
        try:
            stats = data.get("message_stats") or {}
            return float((stats.get("deliver_get_details") or {}).get("rate") or 0.0)
        except (AttributeError, TypeError, ValueError):
            return 0.0


_clients: dict[tuple[Any, ...], ManagementClient] = {}
_clients_lock = threading.Lock()


def _endpoint(url: str) -> tuple[bool, str, int, str]:
    """``(https, host, port, path)`` of one management base URL."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    return https, parts.hostname or "localhost", parts.port or (15671 if https else 15672), parts.path.rstrip("/")


Auth = tuple[str, str]
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def management_endpoint(
    broker_url: str, management_url: str | None, tls: bool = False, plain_http: bool = False
) -> tuple[str, str, tuple[Auth | None, ...], str | None]:
    """``(base URL(s) without credentials, vhost, credentials per base, why some were withheld)``. Pure.

    Several base URLs (a cluster) come back ``;``-separated, in the order
    given. Each endpoint uses the credentials in its own URL, else the
    broker's, never another endpoint's. The broker's credentials never go
    over plain HTTP off this host unless ``plain_http`` (the setting
    ``prio_management_plain_http``) says so; where they are withheld the
    reason comes back (the caller logs it, and the API then goes unused).
    """
    brokers = [url_to_parts(url.strip()) for url in broker_url.split(";") if url.strip()]
    broker = brokers[0]
    vhost = broker.path or "/"
    broker_auth = (
        (urllib.parse.unquote(broker.username), urllib.parse.unquote(broker.password or ""))
        if broker.username
        else None
    )
    if management_url:
        bases, own = [], []
        for url in (u.strip() for u in management_url.split(";") if u.strip()):
            parts = urllib.parse.urlsplit(url)
            own.append(
                (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
                if parts.username
                else None
            )
            netloc = parts.hostname or "localhost"
            if parts.port:
                netloc += f":{parts.port}"
            bases.append(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")))
    else:
        tls = tls or broker.scheme == "amqps"
        scheme, port = ("https", 15671) if tls else ("http", 15672)
        hosts = list(dict.fromkeys(b.hostname or "localhost" for b in brokers))  # failover hosts, once each
        bases, own = [f"{scheme}://{host}:{port}" for host in hosts], [None] * len(hosts)
    auths: list[Auth | None] = []
    withheld = []
    for base, mine in zip(bases, own, strict=True):
        parts = urllib.parse.urlsplit(base)
        if (
            mine is None
            and broker_auth is not None
            and parts.scheme != "https"
            and not plain_http
            and (parts.hostname not in LOOPBACK)
        ):
            withheld.append(base)
            auths.append(None)
        else:
            auths.append(mine or broker_auth)
    problem = None
    if withheld:
        problem = (
            f"the broker's credentials are not sent over plain HTTP to {', '.join(withheld)}: use an https:// "
            f"prio_management_url, put management credentials in that URL, or set "
            f"prio_management_plain_http=True to send them anyway"
        )
    return ";".join(bases), vhost, tuple(auths), problem


def management_client(app: Celery, settings: PrioSettings) -> ManagementClient:
    """The process's one client for this app's management endpoint."""
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://localhost"
    if isinstance(url, (list, tuple)):
        url = url[0]
    *key, problem = management_endpoint(
        url, settings.management_url, tls=bool(app.conf.broker_use_ssl), plain_http=settings.management_plain_http
    )
    with _clients_lock:
        client = _clients.get(tuple(key))
        if client is None:
            if problem:
                logger.error("celery-prio: %s", problem)
            client = _clients[tuple(key)] = ManagementClient(*key)
        return client


def subqueue_pattern(settings: PrioSettings) -> str:
    """Regex of this app's sub-queue names (``<prefix>.<tier>.<name>``, not the front lanes)."""
    tiers = "|".join(re.escape(settings.queue_name(t)) for t in TIERS)
    return rf"^({tiers})\.(?!promoted$)[A-Za-z0-9][A-Za-z0-9_-]{{0,63}}$"


def listed_subqueues(app: Celery, settings: PrioSettings) -> list[tuple[str, int | None]] | None:
    """This app's sub-queues and their ready counts from the management API; None when it cannot list."""
    return management_client(app, settings).list_queues(subqueue_pattern(settings))
