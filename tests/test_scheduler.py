"""Pure scheduler tests: exact pick sequences and share properties, no broker."""

from __future__ import annotations

import pytest

from celery_prio.policy.count_scheduler import scheduler_for
from celery_prio.policy.scheduler import TierScheduler
from celery_prio.policy.start_rate import StartRates
from celery_prio.tiers import Tier

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE
W821 = {R: 8, B: 2, O: 1}


def drive(s: TierScheduler, n: int, runtime: dict[Tier, float], backlog=(R, B, O)) -> str:
    """Dispatch n tasks one at a time on a backlogged worker; return the pick string."""
    picks = []
    for _ in range(n):
        for tier in s.order():
            if tier in backlog:
                break
            s.empty(tier)
        else:
            raise AssertionError("no tier picked")
        charge = s.dispatched(tier)
        s.finished(tier, runtime[tier], charge)
        picks.append("RBO"[tier])
    return "".join(picks)


EQUAL = {R: 1.0, B: 1.0, O: 1.0}


@pytest.mark.parametrize(
    ("mode", "weights", "min_share", "runtime", "expected"),
    [
        # Count mode with no floor is smooth WRR: 8 R, 2 B, 1 O per 11.
        ("count", W821, 0, EQUAL, "RRRRBRRRRBORRRRBRRRRBO"),
        # The floor's first offline task goes at once, then at the weights.
        ("count", W821, 5, EQUAL, "ORRRRBRRRRBRRRRBRRRROB"),
        # Equal run times: time mode and count mode pick alike.
        ("time", W821, 0, EQUAL, "RRRRBRRRRBORRRRBRRRRBO"),
        # Realtime tasks 4x shorter than the others: realtime gets 4x the picks.
        ("time", W821, 0, {R: 0.25, B: 1.0, O: 1.0}, "RRRRRRRRRRRRRRRRBRRRRRRRRRRRRRRRRBORRRRR"),
        # Equal weights, equal costs: plain round robin.
        ("count", {R: 1, B: 1, O: 1}, 0, EQUAL, "RBORBORBO"),
    ],
)
def test_exact_pick_sequences(mode, weights, min_share, runtime, expected):
    s = scheduler_for(mode, weights, concurrency=1, reserve=0, min_share=min_share, estimates=runtime)
    assert drive(s, len(expected), runtime) == expected


def test_time_mode_learns_runtimes_from_a_cold_start():
    s = scheduler_for("time", W821, concurrency=1, min_share=0)
    # Unknown tiers start at the same estimate, so the first picks follow the
    # weights; after that realtime's short tasks earn it more picks.
    assert drive(s, 40, {R: 0.25, B: 1.0, O: 1.0}) == "RBRRORRRRRRRRRRRRRRRRRRRRRRRRRRRRRBRRRRR"


def test_time_mode_converges_to_weight_shares_of_slot_time():
    s = scheduler_for("time", W821, concurrency=1, min_share=0)
    drive(s, 3000, {R: 0.02, B: 0.1, O: 0.4})
    shares = s.shares()
    assert shares[R] == pytest.approx(8 / 11, abs=0.02)
    assert shares[B] == pytest.approx(2 / 11, abs=0.02)
    assert shares[O] == pytest.approx(1 / 11, abs=0.02)


def test_count_mode_gives_realtime_far_less_than_its_time_share():
    # The reason time mode is the default: short realtime tasks lose out.
    s = scheduler_for("count", W821, concurrency=1, min_share=0)
    drive(s, 1100, {R: 0.02, B: 0.1, O: 0.4})
    assert s.shares()[R] < 0.3


@pytest.mark.parametrize("min_share", [0, 5, 10])
def test_time_mode_floor_is_a_share_of_slot_time(min_share):
    # Realtime alone could fill the worker; offline still gets min_share % of the time.
    s = scheduler_for("time", {R: 100, B: 1, O: 1}, concurrency=1, min_share=min_share)
    drive(s, 3000, {R: 0.02, B: 0.1, O: 0.1}, backlog=(R, O))
    # Without a floor offline gets its weight against realtime's (idle batch's is unused): 1/101.
    expected = max(min_share / 100, 1 / 101)
    assert s.shares()[O] == pytest.approx(expected, abs=0.005)


def test_with_realtime_idle_batch_and_offline_keep_their_ratio_by_default():
    """The seed's weighted round robin: an idle tier's turns are skipped, the busy ones keep 2:1."""
    s = scheduler_for("time", W821, concurrency=1)
    drive(s, 3000, {R: 0.02, B: 0.1, O: 0.4}, backlog=(B, O))
    assert s.shares()[B] == pytest.approx(2 / 3, abs=0.02)
    assert s.shares()[O] == pytest.approx(1 / 3, abs=0.02)


def test_next_below_gives_idle_realtime_weight_to_batch_not_spread_over_offline():
    s = scheduler_for("time", W821, concurrency=1, idle_share="next_below")
    drive(s, 3000, {R: 0.02, B: 0.1, O: 0.4}, backlog=(B, O))
    assert s.shares()[B] == pytest.approx(10 / 11, abs=0.02)
    assert s.shares()[O] == pytest.approx(1 / 11, abs=0.02)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # Equal run times, realtime idle: batch and offline 2:1 ...
        ("proportional", "BBOBBOBBOBBOBBOBBOBBOBBO"),
        # ... or 10:1 when realtime's weight goes to batch.
        ("next_below", "BBBBBBBBBBOBBBBBBBBBOBBB"),
    ],
)
def test_idle_share_pick_sequences(rule, expected):
    s = scheduler_for("count", W821, concurrency=1, min_share=0, idle_share=rule)
    assert drive(s, len(expected), EQUAL, backlog=(B, O)) == expected


def test_a_returning_idle_tier_starts_level_with_the_busy_ones():
    s = scheduler_for("count", W821, concurrency=1, min_share=0)
    drive(s, 100, EQUAL, backlog=(B, O))
    assert drive(s, 22, EQUAL) == "RRRRRRRRBORRRRBRRRRBOR"  # 8 R per B+B+O, from the first window on


@pytest.mark.parametrize("min_share", [1, 5, 10, 20])
def test_count_mode_floor_holds_in_every_window_of_100(min_share):
    s = scheduler_for("count", {R: 1000, B: 1, O: 1}, concurrency=1, min_share=min_share)
    picks = drive(s, 500, EQUAL)
    assert min(picks[i : i + 100].count("O") for i in range(400)) >= min_share


def test_no_floor_while_offline_is_empty_and_no_burst_after():
    s = scheduler_for("count", {R: 1000, B: 1, O: 1}, concurrency=1, min_share=5)
    picks = drive(s, 200, EQUAL, backlog=(R,))
    assert "O" not in picks
    # Offline comes back: it gets its floor, not a burst of saved-up picks.
    picks = drive(s, 100, EQUAL)
    assert picks.count("O") <= 6


def test_work_conserving_idle_tier_share_goes_to_others():
    s = scheduler_for("count", W821, concurrency=1, min_share=0)
    assert set(drive(s, 30, EQUAL, backlog=(B, O))) == {"B", "O"}


def test_returning_idle_tier_does_not_burst():
    s = scheduler_for("count", W821, concurrency=1, min_share=0)
    drive(s, 100, EQUAL, backlog=(B, O))  # realtime idle for 100 dispatches
    picks = drive(s, 11, EQUAL)
    assert picks.count("B") >= 1 and picks.count("O") >= 1


KNOWN = {R: 0.02, B: 0.1, O: 0.4}


def test_a_tier_gets_one_slot_until_its_run_time_is_known():
    s = TierScheduler(W821, concurrency=4, reserve=0, served=frozenset({R, O}))
    charge = s.dispatched(O)
    assert s.order() == [R]  # one offline task in flight, its length unknown: the rest for realtime
    s.finished(O, 2.0, charge)
    for _ in range(4):
        assert O in s.order()
        s.dispatched(O)


def test_a_worker_that_serves_no_realtime_keeps_no_slot_from_a_cold_tier():
    """The one-slot rule and the reserve protect realtime arrivals; a worker serving only the app's own queues
    (``-Q default``, a batch-tier queue) runs as many unknown-length tasks as it has slots, like plain Celery."""
    s = TierScheduler(W821, concurrency=2, reserve=0, served=frozenset({B}))
    s.dispatched(B)
    assert s.order() == [B]
    s.dispatched(B)
    assert s.order() == []  # both slots busy


def test_a_task_blocked_on_its_own_children_does_not_hold_the_reserve_from_them():
    """-c 2, one slot reserved: a batch task waiting on its group would deadlock the worker (its children
    could only run in the reserved slot); while it waits, its tier may use that slot."""
    s = TierScheduler(W821, concurrency=2, reserve=1, served=frozenset({R, B, O}))
    s.dispatched(B)
    assert s.order() == [R]  # headroom: the last slot is realtime's
    s.blocked = {B: 1}
    assert B in s.order()
    s.dispatched(B)  # its child
    assert s.order() == []
    s.blocked = {}  # it stopped waiting
    assert s.free_slots() == 0


def test_a_task_blocked_waiting_does_not_hold_its_tiers_cold_start_slot():
    """A batch task waiting on a dependency lifted into batch: the dependency must get a slot.
    (Realtime has no cold-start limit to free: see the test above.)"""
    s = TierScheduler(W821, concurrency=4, reserve=0, served=frozenset({R, B}))
    s.dispatched(B)  # the waiter, run time unknown
    assert s.order() == [R]
    s.blocked = {B: 1}  # it entered celery_prio.wait
    assert B in s.order()
    s.dispatched(B)  # its dependency
    assert s.order() == [R]  # still one unknown-length task that runs
    s.blocked = {}
    assert s.order() == [R]


def test_reserve_keeps_last_slots_for_realtime():
    s = scheduler_for("time", W821, concurrency=4, reserve=1, min_share=0, estimates=KNOWN)
    for _ in range(3):
        tier = next(t for t in s.order() if t is not R)
        s.dispatched(tier)
    assert s.free_slots() == 1
    assert s.order() == [R]  # batch/offline may not take the last slot
    s.dispatched(R)
    assert s.order() == []  # full


def test_realtime_may_fill_every_slot():
    s = TierScheduler(W821, concurrency=4, reserve=1, served=frozenset({R}), estimates=KNOWN)
    for _ in range(4):
        assert s.order() == [R]
        s.dispatched(R)
    assert s.order() == []


def test_served_tiers_limit_the_order():
    s = TierScheduler(W821, concurrency=2, served=frozenset({R}))
    assert s.order() == [R]
    s.set_served([B, O])
    assert set(s.order()) == {B, O}


def test_finished_frees_the_slot_and_learns_runtime():
    s = TierScheduler(W821, concurrency=1)
    charge = s.dispatched(O)
    assert s.order() == []
    s.finished(O, 2.0, charge)
    assert s.free_slots() == 1
    assert s.tiers[O].estimate == pytest.approx(2.0)
    assert s.tiers[O].busy_seconds == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"mode": "fifo"}, "mode"), ({"concurrency": 0}, "concurrency"), ({"idle_share": "spread"}, "idle_share")],
)
def test_bad_arguments(kwargs, message):
    args = {"weights": W821, "concurrency": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        scheduler_for(args.pop("mode", "time"), **args)


# -- GPU time slices: who gives a slot back ------------------------------------------


def busy_with(tier: Tier, concurrency: int = 1, reserve: int = 0, weights=W821) -> TierScheduler:
    s = TierScheduler(weights=weights, concurrency=concurrency, reserve=reserve, estimates={R: 0.02, B: 0.1, O: 0.4})
    for _ in range(concurrency):
        s.dispatched(tier)
    return s


def test_a_sliced_batch_task_yields_to_realtime_only_when_no_slot_is_free():
    assert busy_with(B).preemptors({B}) == {B: {R}}
    s = TierScheduler(weights=W821, concurrency=2, reserve=0, estimates={R: 0.02, B: 0.1, O: 0.4})
    s.dispatched(B)
    assert s.preemptors({B}) == {}  # the free slot takes realtime


def test_only_higher_tiers_preempt_and_realtime_never_yields():
    assert busy_with(R).preemptors({R}) == {}
    assert busy_with(B).preemptors({B}) == {B: {R}}
    assert busy_with(O).preemptors({O}) == {O: {R, B}}


def test_a_tier_over_its_share_does_not_preempt():
    """Batch that already had far more than its share of slot time does not push offline out."""
    s = busy_with(O, weights={R: 8, B: 1, O: 8})
    for _ in range(50):
        s.finished(B, 0.1, s.dispatched(B))
    assert s.preemptors({O}) == {O: {R}}


def test_a_tier_found_empty_still_preempts_and_running_time_so_far_is_charged():
    s = TierScheduler(weights=W821, concurrency=1, reserve=0, estimates={R: 0.02, B: 1.0, O: 0.4})
    for _ in range(3):
        s.finished(R, 0.02, s.dispatched(R))
    s.dispatched(B)
    s.empty(R)  # realtime's last fetch found nothing: its weight went to batch...
    # ...but it ranks first once it has work, against the time the batch run has used by now.
    assert s.preemptors({B}, overrun={B: 5.0}) == {B: {R}}


def test_hand_off_puts_the_tier_yielded_to_first_once():
    s = TierScheduler(weights={R: 1, B: 100, O: 1}, concurrency=1, reserve=0, estimates={R: 0.02, B: 0.1, O: 0.4})
    assert s.order()[0] is B
    s.hand_off_to(R)
    assert s.order()[0] is R
    s.finished(R, 0.02, s.dispatched(R))
    assert s.order()[0] is B


def test_a_cold_worker_gives_a_realtime_burst_every_free_slot_but_a_new_low_tier_only_one():
    """Before any task finished, batch and offline get one slot each (their run time is a guess);
    realtime gets every slot it may use, so a burst into a cold worker does not queue behind its first task."""
    s = TierScheduler(W821, concurrency=4, reserve=1, min_share=0)
    for _ in range(4):
        assert s.order()[0] is R
        s.dispatched(R)
    assert s.order() == []  # all four slots realtime's

    s = TierScheduler(W821, concurrency=4, reserve=0, min_share=0)
    s.empty(R)
    s.dispatched(B)
    assert B not in s.order()  # one batch task running, its run time unknown: no second slot yet
    s.dispatched(O)
    assert s.order() == [R]  # the same for offline; realtime may still come


def test_start_rates_expect_the_starts_of_the_last_second_pace_and_forget_older_ones():
    rates = StartRates()
    assert rates.within(0.05, B, now=0.0) == 0  # nothing started yet: no pace to go by
    for i in range(300):  # batch at 300 starts a second, offline at 30
        rates.started(B, now=i / 300)
        if i % 10 == 0:
            rates.started(O, now=i / 300)
    assert rates.within(0.05, B, now=1.0) == 15  # 300/s x 50 ms
    assert rates.within(0.05, O, now=1.0) == 1  # a tier with a tenth of the turns holds a tenth
    assert rates.within(0.05, B, now=1.5) == 7  # half of the window's starts are older than a second now
    assert rates.within(0.05, B, now=3.0) == 0  # stopped for a while: back to no pace
