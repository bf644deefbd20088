"""The example torch app: a real worker of ``tasks`` on real Redis, and the HTTP front door."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient

from celery_prio import QueueFull
from celery_prio.tools.workers import WorkerProcess
from tests.conftest import REDIS_URL, ROOT, need_broker

torch = pytest.importorskip("torch")

from celery_prio.example import predict  # noqa: E402
from celery_prio.example.http import create_api  # noqa: E402
from celery_prio.example.model import held_out_split  # noqa: E402

pytestmark = [pytest.mark.broker]


def images(n: int, start: int = 0) -> tuple[list, list]:
    _, x, _, y = held_out_split()
    return x[start : start + n].tolist(), y[start : start + n].tolist()


class TasksEnv:
    """The ``tasks`` app against Redis db 13 with its own queue prefix."""

    def __init__(self, tmp_path, **prio: object) -> None:
        self.prefix = f"inf{uuid.uuid4().hex[:8]}"
        self.env = {
            "CELERY_BROKER_URL": REDIS_URL,
            "CELERY_RESULT_BACKEND": REDIS_URL,
            "PRIO_SETTINGS": json.dumps({"queue_prefix": self.prefix, **prio}),
            "PYTHONPATH": str(ROOT),
        }
        self.tmp_path = tmp_path
        self.worker: WorkerProcess | None = None
        import celery_prio
        from celery_prio.example import config

        self.app = Celery("client", set_as_current=False)
        self.app.config_from_object(config)
        self.app.conf.broker_url = self.app.conf.result_backend = REDIS_URL
        celery_prio.install(self.app, queue_prefix=self.prefix, **prio)

    def start_worker(self, concurrency: int = 2, **kwargs) -> WorkerProcess:
        self.worker = WorkerProcess(
            "tasks",
            log_path=self.tmp_path / "tasks-worker.log",
            env=self.env,
            cwd=ROOT,
            concurrency=concurrency,
            **kwargs,
        ).wait_ready()
        return self.worker

    def close(self) -> None:
        if self.worker:
            self.worker.kill()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{self.prefix}*"):
            client.delete(key)


@pytest.fixture
def tasks_env(tmp_path):
    need_broker("redis")
    e = TasksEnv(tmp_path)
    yield e
    e.close()


def test_predictions_in_process():
    x, y = images(64)
    batch = predict.classify_batch(x, micro_batch=16)
    singles = [predict.classify(img) for img in x]
    assert [b["label"] for b in batch] == [s["label"] for s in singles]
    assert sum(b["label"] == t for b, t in zip(batch, y, strict=True)) >= 60
    assert all(len(b["probabilities"]) == 10 and abs(sum(b["probabilities"]) - 1) < 1e-3 for b in batch)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ([[0] * 8] * 7, "must have 8 rows of 8 numbers, got 7 rows"),
        ([[0] * 8] * 7 + [[0] * 9], "row 7 must have 8 numbers, got 9 values"),
        ([[0] * 8] * 7 + [["a"] + [0] * 7], "image[7][0] is 'a' (str), expected a number"),
        ([[0] * 8] * 7 + [[True] + [0] * 7], "image[7][0] is True (bool), expected a number"),
        ([[0] * 8] * 7 + [[17] + [0] * 7], "image[7][0] = 17 is out of range 0..16"),
        ([[0] * 8] * 7 + [[-1] + [0] * 7], "image[7][0] = -1 is out of range 0..16"),
        ("image", "must be an 8x8 nested list of numbers 0..16, got str"),
    ],
)
def test_bad_images_say_what_is_wrong(image, message):
    with pytest.raises(ValueError) as info:
        predict.classify(image)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("batch", "message"),
    [([], "images is empty"), ("x", "images must be a list"), ([[[0] * 8] * 8] * 5000, "more than the limit of 4096")],
)
def test_bad_batches_say_what_is_wrong(batch, message):
    with pytest.raises(ValueError, match=message):
        predict.classify_batch(batch)


@pytest.mark.slow
def test_real_worker_serves_all_three_tasks_and_survives_bad_input(tasks_env):
    tasks_env.start_worker()
    app = tasks_env.app
    x, y = images(20)
    single = app.send_task("tasks.inference.classify", args=[x[0]], tier="realtime").get(timeout=60)
    batch = app.send_task("tasks.inference.classify_batch", args=[x], tier="batch").get(timeout=60)
    assert single == batch[0]
    assert [b["label"] for b in batch] == [predict.classify(img)["label"] for img in x]
    report = app.send_task("tasks.inference.evaluate", tier="offline").get(timeout=120)
    assert report["accuracy"] >= 0.95 and report["n"] == 450
    assert set(report["per_class"]) == {str(d) for d in range(10)}
    assert len(report["confusion_matrix"]) == 10
    with pytest.raises(ValueError, match=r"image\[0\]\[0\] = 99 is out of range"):
        app.send_task("tasks.inference.classify", args=[[[99] * 8] * 8], tier="realtime").get(timeout=60)
    with pytest.raises(ValueError, match="images is empty"):
        app.send_task("tasks.inference.classify_batch", args=[[]], tier="batch").get(timeout=60)
    # ... and the worker keeps serving.
    assert app.send_task("tasks.inference.classify", args=[x[1]], tier="realtime").get(timeout=60)["label"] == y[1]
    stats = next(iter(app.control.inspect(timeout=5, limit=1).stats().values()))
    assert stats["gpus"] == "none (CPU)"
    assert {d["device"] for d in stats["devices"].values()} == {"cpu"}


API_KEY = "test-key-" + "x" * 24


def door(app, deadline_s: float) -> TestClient:
    """The front door as a client with a key uses it."""
    return TestClient(
        create_api(app, deadline_s=deadline_s, api_keys=[API_KEY]), headers={"Authorization": f"Bearer {API_KEY}"}
    )


def test_the_front_door_refuses_without_a_key_and_knows_only_its_own_jobs(tasks_env, monkeypatch):
    from celery_prio.errors import ConfigError

    monkeypatch.delenv("HTTP_API_KEYS", raising=False)
    monkeypatch.delenv("HTTP_AUTH", raising=False)
    with pytest.raises(ConfigError, match="HTTP_API_KEYS"):
        create_api(tasks_env.app)  # no key configured: refused at start, not open to anyone
    api = create_api(tasks_env.app, api_keys=[API_KEY])
    anonymous = TestClient(api)
    for method, path in (("post", "/v1/classify"), ("post", "/v1/evaluate"), ("get", "/v1/tasks/x/result")):
        assert getattr(anonymous, method)(path).status_code == 401
    wrong = TestClient(api, headers={"Authorization": "Bearer nope"})
    assert wrong.get("/v1/tasks/x").status_code == 401
    client = TestClient(api, headers={"X-API-Key": API_KEY})
    # A made-up or foreign id is refused at once: nothing is scanned or lifted for it.
    made_up = client.get("/v1/tasks/0f6c3a4e-1d1b-4bb8-9f37-6ad5a9c4b1f2/result", params={"timeout": 1})
    assert made_up.status_code == 404 and "submitted through this front door" in made_up.json()["detail"]
    huge = client.post("/v1/classify_batch", content=b"[" + b"0," * 3_000_000 + b"0]")
    assert huge.status_code == 413 and "limit" in huge.json()["detail"]
    monkeypatch.setenv("HTTP_AUTH", "none")
    assert TestClient(create_api(tasks_env.app)).get("/v1/tasks/x").status_code == 404  # opted out on purpose


@pytest.mark.slow
def test_http_front_door(tasks_env, tmp_path):
    x, y = images(3)
    # 504: no worker yet, short deadline.
    client = door(tasks_env.app, 0.5)
    assert client.post("/v1/classify", json={"image": x[0]}).status_code == 504
    # 422: the reason is in the body, nothing is published.
    bad = client.post("/v1/classify", json={"image": [[1, 2]]})
    assert bad.status_code == 422 and "must have 8 rows" in bad.json()["detail"]
    assert client.post("/v1/classify", content=b"not json").status_code == 422
    assert client.post("/v1/classify_batch", json={"images": []}).status_code == 422
    # 200 with a worker.
    tasks_env.start_worker()
    client = door(tasks_env.app, 30)
    ok = client.post("/v1/classify", json={"image": x[0]})
    assert ok.status_code == 200 and ok.json()["label"] == y[0]
    accepted = client.post("/v1/classify_batch", json={"images": x})
    assert accepted.status_code == 202
    task_id = accepted.json()["task_id"]
    tasks_env.app.AsyncResult(task_id).get(timeout=60)
    state = client.get(f"/v1/tasks/{task_id}").json()
    assert state["state"] == "SUCCESS" and [r["label"] for r in state["result"]] == y


@pytest.mark.slow
def test_http_waiting_on_a_batch_job_lifts_it_to_realtime(tasks_env):
    """A job submitted with 202 behind a batch backlog; a caller now waits on it: it runs next, not last."""
    x, y = images(4)
    many, _ = images(64)
    client = door(tasks_env.app, 30)
    name = "tasks.inference.classify_batch"
    backlog = [tasks_env.app.send_task(name, args=[many], tier="batch").id for _ in range(300)]
    job = client.post("/v1/classify_batch", json={"images": x}).json()["task_id"]  # behind 300 batch jobs
    assert client.get(f"/v1/tasks/{job}/result", params={"timeout": 0}).status_code == 422
    assert client.get(f"/v1/tasks/{job}/result", params={"timeout": "nan"}).status_code == 422
    tasks_env.start_worker(concurrency=2)
    t0 = time.monotonic()
    done = client.get(f"/v1/tasks/{job}/result", params={"timeout": 20})
    waited = time.monotonic() - t0
    assert done.status_code == 200 and [r["label"] for r in done.json()["result"]] == y, done.json()
    left = sum(1 for task_id in backlog if not tasks_env.app.AsyncResult(task_id).ready())
    assert left > 200, (left, waited)  # most of the backlog is still waiting: the job did not wait for it


@pytest.mark.slow
def test_http_result_lifts_a_job_once_and_never_into_a_full_realtime_tier(tmp_path, monkeypatch):
    """Issue 34, item 8: polling /result does not jump realtime's cap, and polls of one job lift it once."""
    import celery_prio

    need_broker("redis")
    env = TasksEnv(tmp_path, max_length={"realtime": 3})
    lifts: list[str] = []
    boost = celery_prio.boost
    monkeypatch.setattr(celery_prio, "boost", lambda *a, **k: lifts.append(a[0].id) or boost(*a, **k))
    try:
        client = door(env.app, 0.2)
        x, _ = images(1)
        redis_client = redis.Redis.from_url(REDIS_URL)
        first = client.post("/v1/classify_batch", json={"images": [x[0]]}).json()["task_id"]
        for _ in range(4):  # no worker: each poll times out; the job is lifted at its first poll only
            assert client.get(f"/v1/tasks/{first}/result", params={"timeout": 0.05}).status_code == 504
        assert lifts == [first]
        assert redis_client.hget(f"{env.prefix}.stats", "boosted:batch") == b"1"
        for _ in range(2):  # realtime now holds its cap of 3 (the lifted job and two calls)
            env.app.send_task("tasks.inference.classify", args=[x[0]], tier="realtime")
        second = client.post("/v1/classify_batch", json={"images": [x[0]]}).json()["task_id"]
        assert client.get(f"/v1/tasks/{second}/result", params={"timeout": 0.05}).status_code == 504
        refused = boost(second, "realtime", app=env.app)
        assert refused.outcome == "refused" and "prio_max_length" in refused.detail, refused
        assert redis_client.hget(f"{env.prefix}.stats", "boosted:batch") == b"1"  # it stayed in batch
        assert redis_client.llen(f"{env.prefix}.batch") == 1
    finally:
        env.close()


@pytest.mark.slow
def test_http_429_when_the_realtime_tier_is_full(tmp_path):
    need_broker("redis")
    env = TasksEnv(tmp_path, max_length={"realtime": 5})
    try:
        client = door(env.app, 0.2)
        x, _ = images(1)
        for _ in range(5):  # no worker: each waits out its deadline in the queue
            assert client.post("/v1/classify", json={"image": x[0]}).status_code == 504
        full = client.post("/v1/classify", json={"image": x[0]})
        assert full.status_code == 429
        assert int(full.headers["Retry-After"]) >= 1
        assert "realtime tier is full (5 waiting)" in full.json()["detail"]
    finally:
        env.close()


def test_gpu_pinning_round_robin(monkeypatch):
    from celery_prio.errors import ConfigError
    from celery_prio.worker.gpus import PINNED_ENV, parse_gpus, pin_this_process

    monkeypatch.setenv("CELERY_PRIO_GPUS", "0,1")
    pinned = []
    for index in range(1, 5):  # pool children 1..4, each in a fresh process environment
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")  # --prio-gpus counts inside this list
        monkeypatch.delenv(PINNED_ENV, raising=False)
        pinned.append((pin_this_process(index), os.environ["CUDA_VISIBLE_DEVICES"]))
    assert pinned == [("5", "5"), ("4", "4"), ("5", "5"), ("4", "4")]
    assert pin_this_process(2) == "4"  # pinned once per process: a second call changes nothing
    monkeypatch.delenv("CELERY_PRIO_GPUS")
    monkeypatch.delenv(PINNED_ENV)
    assert pin_this_process(0) is None
    with pytest.raises(ConfigError, match="--prio-gpus, prio_gpus and CELERY_PRIO_GPUS take GPU numbers"):
        parse_gpus("0,a")
    assert parse_gpus([0, 1]) == ["0", "1"] and parse_gpus(None) == []


#: A request a warm process serves took 15-75 ms here (two cores, busy or not) and 391 ms once on a loaded CI
#: host; a cold one pays importing torch (0.9-1.0 s here) and loading the model before it runs: this bound
#: tells the two apart with room on either side.
WARM_REQUEST_MS = 600


def _first_request_ms(env: TasksEnv) -> float:
    import time

    image, _ = images(1)
    started = time.perf_counter()
    result = env.app.send_task("tasks.inference.classify", args=[image[0]], tier="realtime").get(timeout=20)
    assert "label" in result
    return (time.perf_counter() - started) * 1000


def _warm_client(env: TasksEnv) -> None:
    """Connect the client to broker and backend first: the test measures the worker, not the client's dial."""
    env.app.send_task("tasks.inference.nothing", queue=f"{env.prefix}.unused")
    env.app.AsyncResult("warm-the-backend").state  # noqa: B018


@pytest.mark.slow
def test_first_realtime_request_after_start_is_warm(tasks_env):
    _warm_client(tasks_env)
    worker = tasks_env.start_worker()
    assert "model warm in every pool process" in worker.log()  # before "ready."
    assert worker.log().index("model warm in every pool process") < worker.log().index("ready.")
    assert _first_request_ms(tasks_env) < WARM_REQUEST_MS
    stats = next(iter(tasks_env.app.control.inspect(timeout=5).stats().values()))
    devices = stats["devices"]
    assert len(devices) == 2
    assert all(d["device"] == "cpu" and d["load_s"] >= 0 and d["warmup_s"] >= 0 for d in devices.values())


@pytest.mark.slow
def test_a_recycled_child_is_warm_before_it_takes_a_task(tasks_env):
    import time

    _warm_client(tasks_env)
    worker = tasks_env.start_worker(concurrency=1, extra_args=["--max-tasks-per-child", "1"])
    assert _first_request_ms(tasks_env) < WARM_REQUEST_MS
    for n in range(2, 4):  # each request runs in a child forked after the previous one
        deadline = time.monotonic() + 60
        while worker.log().count(" warm on ") < n:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.05)
        assert _first_request_ms(tasks_env) < WARM_REQUEST_MS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("corrupt", "could not load the model: RuntimeError"),
        ("no-such-model", "could not load the model: ValueError: unknown model 'no-such-model'"),
    ],
)
def test_a_model_that_cannot_load_stops_the_worker_with_the_reason(tasks_env, tmp_path, model, message):
    if model == "corrupt":
        model = str(tmp_path / "model.pt")
        (tmp_path / "model.pt").write_bytes(b"this is not a TorchScript archive")
    tasks_env.env["INFERENCE_MODEL"] = model
    worker = WorkerProcess("tasks", log_path=tmp_path / "bad-model.log", env=tasks_env.env, cwd=ROOT, concurrency=2)
    tasks_env.worker = worker
    assert worker.proc.wait(90) != 0
    log = worker.log()
    assert message in log, log[-3000:]
    assert "ready." not in log


@pytest.mark.slow
def test_sliced_example_tasks_match_unsliced_runs(tmp_path):
    """classify_batch and evaluate yield to realtime classify between micro-batches; results are unchanged."""
    need_broker("redis")
    # The realtime stream is more than one slot shared with two sliced tiers serves within the default wait
    # budget: a refused call is what a caller sees (QueueFull), and it degrades; none may wait past a deadline.
    env = TasksEnv(tmp_path, reserve=0, slice={"batch": 0.01, "offline": 0.01}, realtime_deadline=0)
    env.env["INFERENCE_MICRO_BATCH"] = "8"
    try:
        env.start_worker(concurrency=1)
        app = env.app
        x, _ = images(450)
        x = (x * 9)[:4000]
        batch = app.send_task("tasks.inference.classify_batch", args=[x], tier="batch")
        report = app.send_task("tasks.inference.evaluate", tier="offline")
        realtime, refused = [], 0
        while not (batch.ready() and report.ready()):
            try:
                call = app.send_task("tasks.inference.classify", args=[x[len(realtime) % 450]], tier="realtime")
                realtime.append(call)
            except QueueFull as full:
                assert full.reason == "wait", full
                refused += 1
            time.sleep(0.05)
        assert realtime, f"every realtime call was refused ({refused})"
        assert all(r.get(timeout=30)["label"] in range(10) for r in realtime)
        assert batch.get(timeout=5) == predict.classify_batch(x, micro_batch=8)
        unsliced = predict.evaluate()
        got = report.get(timeout=5)
        assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in unsliced.items() if k != "seconds"}
        from celery_prio.worker.control import collect_prio_stats

        (stats,) = collect_prio_stats(app, timeout=3, limit=1).values()
        assert stats["tiers"]["batch"]["yields"] + stats["tiers"]["offline"]["yields"] >= 1, stats
    finally:
        env.close()
