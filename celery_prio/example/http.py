"""HTTP front door for online inference (FastAPI).

    uvicorn tasks.http:api --host 127.0.0.1 --port 8000

POST /v1/classify        {"image": 8x8}   -> 200 {"label", "probabilities"}; waits up to the deadline
POST /v1/classify_batch  {"images": [...]} -> 202 {"task_id"}
POST /v1/evaluate        {}               -> 202 {"task_id"}
GET  /v1/tasks/{id}                       -> {"state", "result" | "error"}
GET  /v1/tasks/{id}/result?timeout=2      -> 200 {"state", "result" | "error"}: someone waits on it now,
                                             so the job is lifted to realtime (celery_prio.boost) once, if
                                             realtime has room under its cap; 504 at timeout

A full realtime tier answers 429 with Retry-After, so callers can degrade
instead of queueing; a missed deadline answers 504 (and revokes the task);
a bad body answers 422 with the reason, one over ``HTTP_MAX_BODY_BYTES`` 413.

Every route needs an API key (``HTTP_API_KEYS``, sent as ``Authorization:
Bearer <key>``) or an auth dependency of the operator's (``create_api(auth=)``);
``HTTP_AUTH=none`` opts out on a trusted network. Job ids are signed
(``HTTP_JOB_SECRET``), so ``/result`` lifts only jobs this door submitted
(anything else: 404, no broker scan). A lift is admitted like a realtime
publish: into a full realtime tier it is refused and the job waits in its
own tier (a key holder cannot jump realtime's 429 by polling). Each job is
lifted at most once (a refused lift is tried again at most once a second),
so polling costs no broker scan. Waits hold no thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import os
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from celery import Celery
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

import celery_prio
from celery_prio import QueueFull
from celery_prio.boost import SETTLED
from celery_prio.errors import ConfigError

from .checks import check_batch, check_image

DEADLINE_S = float(os.environ.get("HTTP_DEADLINE_S", "2.0"))
MAX_WAIT_S = 60.0  # longest a caller may hold a request open waiting on a job
#: Largest request body read (a full batch of 4,096 8x8 images as JSON is about 1 MB).
MAX_BODY_BYTES = int(os.environ.get("HTTP_MAX_BODY_BYTES", str(4 * 1024 * 1024)))
#: Requests waiting on a result at once; more answer 503 (a wait holds no thread, but each one polls).
MAX_WAITERS = int(os.environ.get("HTTP_MAX_WAITERS", "1000"))
#: Jobs whose lift this door remembers (tried, and when): polls of one job lift it once.
MAX_LIFTS_REMEMBERED = 10_000
#: Seconds before a refused lift (realtime was full) of one job is tried again.
LIFT_RETRY_S = 1.0
#: Poll intervals while waiting on a result: short at first (realtime answers come in milliseconds).
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.1


class Refused(Exception):
    """A request refused before anything was published: its status and reason."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _too_many(exc: QueueFull) -> JSONResponse:
    return _error(429, str(exc), {"Retry-After": str(max(1, math.ceil(exc.retry_after)))})


async def _json_field(request: Request, name: str) -> Any:
    size = 0
    chunks = []
    async for chunk in request.stream():  # counted as it comes: a huge body is never held whole
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise Refused(413, f"request body is larger than the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError:
        raise ValueError("body must be JSON") from None
    if not isinstance(body, dict) or name not in body:
        raise ValueError(f'body must be a JSON object with "{name}"')
    return body[name]


def api_key_auth(keys: list[str]) -> Callable[[Request], None]:
    """A dependency that accepts ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` for one of ``keys``."""
    encoded = [k.encode() for k in keys]

    def check(request: Request) -> None:
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not any(hmac.compare_digest(given.encode(), k) for k in encoded):  # constant time, every key
            raise Refused(
                401, "missing or wrong API key (send Authorization: Bearer <key>)", {"WWW-Authenticate": "Bearer"}
            )

    return check


def _auth_from_environment() -> Callable[..., Any] | None:
    keys = [k.strip() for k in os.environ.get("HTTP_API_KEYS", "").split(",") if k.strip()]
    if keys:
        return api_key_auth(keys)
    if os.environ.get("HTTP_AUTH", "").strip().lower() == "none":
        return None  # said on purpose: a network the operator trusts
    raise ConfigError(
        "the HTTP front door needs an API key: set HTTP_API_KEYS=<key>[,<key>...] (clients send "
        "Authorization: Bearer <key>), pass create_api(auth=<a FastAPI dependency>), or set HTTP_AUTH=none "
        "on a network you trust"
    )


class JobIds:
    """Task ids this front door mints: ``<uuid>.<tag>``, the tag an HMAC of the uuid under ``secret``.

    Only a job submitted through a front door holding the secret (every
    replica, with ``HTTP_JOB_SECRET``) can be asked about or lifted to
    realtime here: an id guessed, copied from elsewhere or made up is
    refused at once, with no broker scan.
    """

    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def _tag(self, raw: str) -> str:
        return hmac.new(self.secret, raw.encode(), hashlib.sha256).hexdigest()[:24]

    def mint(self) -> str:
        raw = str(uuid.uuid4())
        return f"{raw}.{self._tag(raw)}"

    def ours(self, task_id: str) -> bool:
        raw, _, tag = task_id.rpartition(".")
        return bool(raw) and hmac.compare_digest(tag, self._tag(raw))


def create_api(
    celery_app: Celery | None = None,
    deadline_s: float = DEADLINE_S,
    *,
    api_keys: list[str] | None = None,
    auth: Callable[..., Any] | None = None,
    job_secret: bytes | None = None,
) -> FastAPI:
    """The front door. Every route needs ``auth`` (a FastAPI dependency), else one of ``api_keys``, else the
    ``HTTP_API_KEYS`` environment; ``HTTP_AUTH=none`` opts out on purpose. ``job_secret`` (or
    ``HTTP_JOB_SECRET``) signs the job ids it hands out; replicas that share it know each other's jobs."""
    if celery_app is None:
        from .app import app as celery_app
    if auth is None:
        auth = api_key_auth(api_keys) if api_keys else _auth_from_environment()
    secret = job_secret or os.environ.get("HTTP_JOB_SECRET", "").encode() or secrets.token_bytes(32)
    jobs = JobIds(secret)
    waiters = asyncio.Semaphore(MAX_WAITERS)
    lifts: OrderedDict[str, float] = OrderedDict()  # job id -> when to try its lift again (inf: never)
    api = FastAPI(title="celery-prio inference", version="1", dependencies=[Depends(auth)] if auth else [])

    @api.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return _error(exc.status, exc.detail, exc.headers)

    def publish(name: str, args: list, tier: str):
        return celery_app.send_task(name, args=args, tier=tier, task_id=jobs.mint())

    async def settled(result: Any, timeout: float) -> bool:
        """Wait for ``result`` without holding a thread (each look is one short backend read)."""
        if waiters.locked():
            raise Refused(503, f"too many requests are waiting on results (limit {MAX_WAITERS})", {"Retry-After": "1"})
        async with waiters:
            loop = asyncio.get_running_loop()
            deadline, pause = loop.time() + timeout, POLL_FIRST_S
            while True:
                if await run_in_threadpool(result.ready):
                    return True
                left = deadline - loop.time()
                if left <= 0:
                    return False
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, POLL_MAX_S)

    @api.post("/v1/classify")
    async def classify(request: Request):
        try:
            image = await _json_field(request, "image")
            check_image(image)
        except ValueError as exc:
            return _error(422, str(exc))
        try:
            result = await run_in_threadpool(publish, "tasks.inference.classify", [image], "realtime")
        except QueueFull as exc:
            return _too_many(exc)
        if not await settled(result, deadline_s):
            result.revoke()  # nobody waits for it any more: do not spend GPU time on it
            return _error(504, f"no result within the {deadline_s:g} s deadline")
        if result.state == "FAILURE":
            return _error(422, str(result.result))
        return result.result

    async def submit(request: Request, field: str | None, name: str, tier: str, check) -> JSONResponse:
        args: list = []
        if field is not None:
            try:
                value = await _json_field(request, field)
                check(value)
            except ValueError as exc:
                return _error(422, str(exc))
            args = [value]
        try:
            result = await run_in_threadpool(publish, name, args, tier)
        except QueueFull as exc:
            return _too_many(exc)
        return JSONResponse({"task_id": result.id}, status_code=202)

    @api.post("/v1/classify_batch")
    async def classify_batch(request: Request):
        return await submit(request, "images", "tasks.inference.classify_batch", "batch", check_batch)

    @api.post("/v1/evaluate")
    async def evaluate(request: Request):
        return await submit(request, None, "tasks.inference.evaluate", "offline", None)

    def described(result: Any) -> dict[str, Any]:
        state = result.state
        if state == "SUCCESS":
            return {"task_id": result.id, "state": state, "result": result.result}
        if state == "FAILURE":
            return {"task_id": result.id, "state": state, "error": repr(result.result)}
        return {"task_id": result.id, "state": state}

    def our_job(task_id: str) -> Any:
        if not jobs.ours(task_id):
            raise Refused(404, f"no job {task_id!r} was submitted through this front door")
        return celery_app.AsyncResult(task_id)

    @api.get("/v1/tasks/{task_id}")
    async def task_state(task_id: str):
        return await run_in_threadpool(described, our_job(task_id))

    async def lift_once(result: Any) -> None:
        """Lift the job into realtime once (the broker admits it under realtime's cap, else it stays in its tier);
        later polls of it cost nothing on the broker."""
        loop_now = asyncio.get_running_loop().time()
        if lifts.get(result.id, 0.0) > loop_now:
            return
        outcome = await run_in_threadpool(celery_prio.boost, result, "realtime")
        lifts[result.id] = math.inf if outcome.outcome in SETTLED else loop_now + LIFT_RETRY_S
        lifts.move_to_end(result.id)
        while len(lifts) > MAX_LIFTS_REMEMBERED:
            lifts.popitem(last=False)

    @api.get("/v1/tasks/{task_id}/result")
    async def task_result(task_id: str, timeout: float = deadline_s):
        """A caller waits on a batch or offline job now: lift it to realtime, then wait (priority inheritance)."""
        if not math.isfinite(timeout) or not 0 < timeout <= MAX_WAIT_S:
            return _error(422, f"timeout must be a number of seconds in (0, {MAX_WAIT_S:g}], got {timeout!r}")
        result = our_job(task_id)
        await lift_once(result)
        if not await settled(result, timeout):
            return _error(504, f"no result within {timeout:g} s (the job was lifted to realtime; ask again)")
        return await run_in_threadpool(described, result)

    return api


def __getattr__(name: str) -> Any:
    # ``uvicorn tasks.http:api`` builds the app on first use, from the environment.
    if name == "api":
        globals()["api"] = built = create_api()
        return built
    raise AttributeError(name)
