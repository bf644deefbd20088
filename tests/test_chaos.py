"""The chaos test (issues 26, 34): three workers (the first ``-P solo``, holding the housekeeper lease
while it runs long tasks) SIGKILLed and restarted in place at random, and the broker (a private
redis-server with an append-only file) SIGKILLed and restarted once, then made a replica and primary
again, under a mixed load of realtime's shortest-first queues, batch and offline with aging, tenant
sub-queues filled by ``bulk``, sliced tasks, boosts and chords of batched calls. At the end: every
accepted task completed, none ran twice unless a kill explains it (acks_late), every sliced result has
each element exactly once, nothing left unacked or owned. ``celery-prio bench --only chaos`` runs the
same, longer, with the default bounds."""

from __future__ import annotations

import shutil

import pytest

from celery_prio.tools.chaos import run_chaos

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_chaos_loses_nothing_and_runs_nothing_twice_unexplained(tmp_path, redis_env):
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary to run a private Redis")
    lines: list[str] = []
    result = run_chaos(tmp_path, duration=16.0, workers=3, seed=7, record_url=redis_env.backend, out=lines.append)
    print("\n".join(lines))
    assert result.kills >= 2 and result.broker_restarts == 1 and result.failovers == 1, lines
    assert sum(result.accepted.values()) >= 100 and result.boosts >= 1, lines
    assert result.accepted["chord"] >= 5 and result.accepted["long"] >= 1, lines
    assert result.ok, (lines, result.lost[:10], result.ran_twice_unexplained[:10], result.sliced_wrong[:5])
