"""The benchmark's own arithmetic, and one short real run so it cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from celery_prio.tools.bench.core import Workload, best_of, percentile, round_ratios, run_mixed, summarize
from celery_prio.tools.bench.scale import process_cpu
from tests.conftest import need_broker


def test_percentile_and_best_of():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    calls = []
    best = best_of(2, {"a": ("fifo", {"x": 1}), "b": ("prio", {})}, lambda mode, **o: calls.append(mode) or len(calls))
    assert calls == ["fifo", "prio", "prio", "fifo"]  # interleaved, order rotated each round
    assert best == {"a": 4, "b": 3}
    # Ratios within each round (pairs that ran side by side), not of each side's best.
    assert round_ratios([3.0, 2.0, 8.0], [2.0, 2.0, 4.0]) == (1.0, 1.5, 2.0)
    with pytest.raises(ValueError):
        round_ratios([1.0], [1.0, 2.0])  # rounds that do not pair up are a bug, not a figure


def test_process_cpu_counts_one_process_and_nothing_for_one_gone():
    before, t0 = process_cpu(os.getpid()), time.process_time()
    while time.process_time() - t0 < 0.3:  # burn 0.3 s of this process's CPU
        pass
    assert process_cpu(os.getpid()) - before >= 0.2
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_cpu(gone.pid) == 0.0


def test_summarize_counts_unanswered_requests_at_the_cutoff():
    w = Workload(duration=10, offline_backlog=1)
    records = [("realtime", 0.0, 0.1, 0.2), ("batch", 0.0, 1.0, 2.0), ("offline", 1.0, 6.0, 8.0)]
    out = summarize(records, t0=0.0, t_end=10.0, cutoff=12.0, sent_rt=2, offline_sent=[1.0, 3.0], w=w)
    assert out["realtime"]["done"] == 1 and out["realtime"]["p99_ms"] > 11_000  # the unanswered one: 12 s
    assert out["offline"]["longest_wait_s"] == 9.0  # the one sent at 3.0 never started: 12 - 3
    assert out["offline"]["busy_late_s"] == 2.0  # it ran 6..8 s, inside the 5..10 s second half
    assert out["batch"]["per_s"] == 0.1


@pytest.mark.slow
@pytest.mark.broker
def test_a_short_mixed_run_on_redis(tmp_path):
    need_broker("redis")
    w = Workload(duration=2, offline_backlog=2, offline_seconds=0.5, grace=2)
    out = run_mixed("prio", "redis://127.0.0.1:6379/14", w, tmp_path)
    assert out["realtime"]["sent"] > 0 and out["realtime"]["done"] == out["realtime"]["sent"]
    assert out["batch"]["done"] > 0


def test_a_batches_python_that_cannot_run_the_baseline_is_refused_with_what_to_do(tmp_path):
    from celery_prio.tools.bench.batching import baseline_python

    for python in (str(tmp_path / "no-such-python"), sys.executable if has_no_batches() else "/bin/false"):
        with pytest.raises(SystemExit, match=r"--batches-python .*cannot import celery_batches.*batches-baseline"):
            baseline_python(python)


def has_no_batches() -> bool:
    from celery_prio.tools.benchapp import has_celery_batches

    return not has_celery_batches()
