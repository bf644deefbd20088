"""HTTP front door for online inference (FastAPI).

    uvicorn tasks.http:api --host 127.0.0.1 --port 8000

POST /v1/classify        {"image": 8x8}   -> 200 {"label", "probabilities"}; waits up to the deadline
POST /v1/classify_batch  {"images": [...]} -> 202 {"task_id"}
POST /v1/evaluate        {}               -> 202 {"task_id"}
GET  /v1/tasks/{id}                       -> {"state", "result" | "error"}
GET  /v1/tasks/{id}/result?timeout=2      -> 200 {"state", "result" | "error"}: someone waits on it now,
                                             so the job is lifted to realtime (celery_prio.wait); 504 at timeout

A full realtime tier answers 429 with Retry-After, so callers can degrade
instead of queueing; a missed deadline answers 504 (and revokes the task);
a bad body answers 422 with the reason.
"""

from __future__ import annotations

import math
import os
from typing import Any

from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

import celery_prio
from celery_prio import QueueFull

from .checks import check_batch, check_image

DEADLINE_S = float(os.environ.get("HTTP_DEADLINE_S", "2.0"))
MAX_WAIT_S = 60.0  # longest a caller may hold a request open waiting on a job


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _too_many(exc: QueueFull) -> JSONResponse:
    return _error(429, str(exc), {"Retry-After": str(max(1, math.ceil(exc.retry_after)))})


async def _json_field(request: Request, name: str) -> Any:
    try:
        body = await request.json()
    except ValueError:
        raise ValueError("body must be JSON") from None
    if not isinstance(body, dict) or name not in body:
        raise ValueError(f'body must be a JSON object with "{name}"')
    return body[name]


def create_api(celery_app: Celery | None = None, deadline_s: float = DEADLINE_S) -> FastAPI:
    if celery_app is None:
        from .app import app as celery_app
    api = FastAPI(title="celery-prio inference", version="1")

    def publish(name: str, args: list, tier: str):
        return celery_app.send_task(name, args=args, tier=tier)

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
        try:
            return await run_in_threadpool(result.get, timeout=deadline_s)
        except CeleryTimeout:
            result.revoke()  # nobody waits for it any more: do not spend GPU time on it
            return _error(504, f"no result within the {deadline_s:g} s deadline")
        except ValueError as exc:
            return _error(422, str(exc))

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

    @api.get("/v1/tasks/{task_id}")
    async def task_state(task_id: str):
        return described(celery_app.AsyncResult(task_id))

    @api.get("/v1/tasks/{task_id}/result")
    async def task_result(task_id: str, timeout: float = deadline_s):
        """A caller waits on a batch or offline job now: lift it to realtime, then wait (priority inheritance)."""
        if not math.isfinite(timeout) or not 0 < timeout <= MAX_WAIT_S:
            return _error(422, f"timeout must be a number of seconds in (0, {MAX_WAIT_S:g}], got {timeout!r}")
        result = celery_app.AsyncResult(task_id)
        try:
            await run_in_threadpool(celery_prio.wait, result, timeout, tier="realtime", propagate=False)
        except CeleryTimeout:
            return _error(504, f"no result within {timeout:g} s (the job was lifted to realtime; ask again)")
        return described(result)

    return api


def __getattr__(name: str) -> Any:
    # ``uvicorn tasks.http:api`` builds the app on first use, from the environment.
    if name == "api":
        globals()["api"] = built = create_api()
        return built
    raise AttributeError(name)
