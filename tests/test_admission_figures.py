"""The arithmetic of admission by predicted wait (``policy/admission.py``): pure, no broker."""

from __future__ import annotations

import json

import pytest

from celery_prio import Tier
from celery_prio.policy.admission import FleetRecord, has_news, merge_reports, predicted_wait, slot_share

W = {Tier.REALTIME: 8.0, Tier.BATCH: 2.0, Tier.OFFLINE: 1.0}


def test_a_worker_gives_a_tier_its_slots_split_by_the_weights_of_the_tiers_it_serves():
    assert slot_share(4, Tier.REALTIME, [Tier.REALTIME], W) == 4
    assert slot_share(4, Tier.REALTIME, list(Tier), W) == pytest.approx(4 * 8 / 11)
    assert slot_share(4, Tier.BATCH, [Tier.REALTIME], W) == 0
    assert slot_share(0, Tier.REALTIME, [Tier.REALTIME], W) == 1  # a worker has one slot at least


def test_the_predicted_wait_is_the_work_ahead_over_the_slots():
    assert predicted_wait([(10, 0.02), (5, 0.1)], 2.0) == pytest.approx((0.2 + 0.5) / 2)
    assert predicted_wait([(10, None), (0, 5.0)], 2.0) == 0  # no estimate yet: counts nothing
    assert predicted_wait([(10, 0.02)], 0) is None  # no live slot known: the cap alone


def test_reports_merge_into_the_fleets_record():
    a = FleetRecord({Tier.REALTIME: 2.0}, {"q.a": 0.1, "q.b": 0.3})
    b = FleetRecord({Tier.REALTIME: 1.5, Tier.BATCH: 0.5}, {"q.a": 0.3})
    fleet = merge_reports([a, b])
    assert fleet.slots == {Tier.REALTIME: 3.5, Tier.BATCH: 0.5, Tier.OFFLINE: 0.0}
    assert fleet.estimates == {"q.a": pytest.approx(0.2), "q.b": 0.3}
    assert FleetRecord.from_json(json.loads(json.dumps(fleet.to_json()))) == fleet


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        "x",
        {},
        {"slots": []},
        {"slots": {"realtime": -1}},
        {"slots": {"realtime": "2"}},
        {"slots": {"realtime": True}},
    ],
)
def test_what_is_not_a_record_is_no_record(data):
    assert FleetRecord.from_json(data) is None  # anyone can publish to a queue: never a crash, never a figure


def test_bad_figures_in_a_record_are_dropped():
    record = FleetRecord.from_json(
        {"slots": {"realtime": 2, "batch": float("nan")}, "estimates": {"q": 0.1, "bad": -1, "worse": "1", 3: 1}}
    )
    assert record == FleetRecord({Tier.REALTIME: 2.0}, {"q": 0.1})


def test_news_is_a_queue_measured_first_or_an_estimate_that_moved():
    sent = FleetRecord({Tier.REALTIME: 1.0}, {"q": 0.1})
    assert not has_news(sent, FleetRecord({Tier.REALTIME: 1.0}, {"q": 0.12}))
    assert has_news(sent, FleetRecord({Tier.REALTIME: 1.0}, {"q": 0.2}))  # slower by 2x
    assert has_news(sent, FleetRecord({Tier.REALTIME: 1.0}, {"q": 0.05}))  # faster by 2x
    assert has_news(sent, FleetRecord({Tier.REALTIME: 1.0}, {"q": 0.1, "r": 1.0}))  # a queue measured first
    assert has_news(None, FleetRecord({}, {"q": 0.1})) and not has_news(None, FleetRecord({}, {}))


def test_goodput_counts_realtime_calls_answered_within_the_target_publish_to_done():
    from celery_prio.worker.stats import WorkerStats

    stats = WorkerStats(target=0.2)
    stats.observe_run(Tier.REALTIME, 0.05, waited=0.1)  # 150 ms: on time
    stats.observe_run(Tier.REALTIME, 0.05, waited=0.3)  # 350 ms: late
    stats.observe_run(Tier.REALTIME, 0.05)  # no publish stamp: not counted either way
    stats.observe_run(Tier.BATCH, 0.05, waited=0.0)  # batch has no latency target
    assert (stats.summary(Tier.REALTIME)["answered"], stats.summary(Tier.REALTIME)["on_time"]) == (2, 1)
    assert stats.summary(Tier.BATCH)["answered"] == 0


def test_a_batched_tasks_calls_are_counted_at_their_share_of_a_run():
    from celery_prio.policy.served import ServedQueues
    from celery_prio.settings import load_settings

    settings = load_settings({})
    queue = settings.queue_name(Tier.REALTIME)
    served = ServedQueues(settings, [queue])
    served.dispatched(queue)
    served.finished(queue, 0.32, 0.0)  # one run of 0.32 s ...
    assert served.per_call_estimates()[queue] == pytest.approx(0.32)
    served.batch_ran(queue, 32)  # ... that was a batch of 32 calls: 10 ms a call
    assert served.per_call_estimates()[queue] == pytest.approx(0.01)
    assert served.per_call_estimates([Tier.BATCH]) == {}


def test_the_refusal_counters_are_those_redis_keeps_for_every_tier():
    from celery_prio.policy.admission import REFUSAL_COUNTERS

    assert sorted(REFUSAL_COUNTERS) == sorted(f"{k}:{t.label}" for k in ("rejected", "refused_wait") for t in Tier)


def test_a_backlog_drains_at_the_rate_of_the_slots_between_readings():
    from celery_prio.policy.admission import Backlog

    backlog = Backlog(read_at=0.0, messages=10, work=0.2, at=0.0)  # 10 calls of 20 ms read at t=0
    assert backlog.drained(0.05, 2.0) == pytest.approx(0.1)  # two slots ran 0.1 s of it in 50 ms
    backlog.work += 0.02  # a call admitted
    assert backlog.drained(0.2, 2.0) == 0  # run dry: never below nothing
