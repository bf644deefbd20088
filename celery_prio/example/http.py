"""HTTP front door for online inference (FastAPI).

    uvicorn tasks.http:api --host 127.0.0.1 --port 8000

POST /v1/classify        {"image": 8x8}   -> 200 {"label", "probabilities"}; waits up to the deadline
POST /v1/classify_batch  {"images": [...]} -> 202 {"task_id"}
POST /v1/evaluate        {}               -> 202 {"task_id"}
GET  /v1/tasks/{id}                       -> {"state", "result" | "error"}

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

from celery_prio import QueueFull

from .checks import check_batch, check_image

DEADLINE_S = float(os.environ.get("HTTP_DEADLINE_S", "2.0"))


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

    @api.get("/v1/tasks/{task_id}")
    async def task_state(task_id: str):
        result = celery_app.AsyncResult(task_id)
        state = result.state
        if state == "SUCCESS":
            return {"task_id": task_id, "state": state, "result": result.result}
        if state == "FAILURE":
            return {"task_id": task_id, "state": state, "error": repr(result.result)}
        return {"task_id": task_id, "state": state}

    return api


def __getattr__(name: str) -> Any:
    # ``uvicorn tasks.http:api`` builds the app on first use, from the environment.
    if name == "api":
        globals()["api"] = built = create_api()
        return built
    raise AttributeError(name)
