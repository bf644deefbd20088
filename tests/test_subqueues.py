"""Sub-queues inside a tier: the pure share of a tier's slot time among its queues, and the settings."""

from __future__ import annotations

import pytest

from celery_prio.errors import ConfigError
from celery_prio.policy.queue_shares import QueueShares
from celery_prio.settings import load_settings
from celery_prio.tiers import Tier


def run(shares: QueueShares, backlog: dict[str, int], runtime: dict[str, float], picks: int) -> list[str]:
    """One slot: take the most deserving queue that has work, run it, repeat."""
    out = []
    for _ in range(picks):
        for name in shares.order(backlog):
            if backlog[name]:
                break
            shares.empty(name)
        else:
            break
        backlog[name] -= 1
        shares.finished(name, runtime[name], shares.dispatched(name))
        out.append(name)
    return out


def test_a_trickle_is_not_stuck_behind_a_flood():
    shares = QueueShares(lambda name: 1.0)
    picks = run(shares, {"flood": 10_000, "trickle": 3}, {"flood": 0.05, "trickle": 0.05}, 7)
    assert picks.count("trickle") == 3  # in turn with the flood, not after its 10,000


def test_slot_time_follows_weights_not_task_counts():
    weights = {"a": 3.0, "b": 1.0}
    shares = QueueShares(weights.__getitem__)
    run(shares, {"a": 100_000, "b": 100_000}, {"a": 0.2, "b": 0.05}, 2000)
    busy = {name: state.busy_seconds for name, state in shares.queues.items()}
    assert busy["a"] / busy["b"] == pytest.approx(3.0, rel=0.05)


def test_an_idle_queue_does_not_bank_credit_and_a_new_one_starts_level():
    shares = QueueShares(lambda name: 1.0)
    run(shares, {"a": 1000, "b": 0}, {"a": 0.1, "b": 0.1}, 500)  # b idle while a runs 500 tasks
    picks = run(shares, {"a": 1000, "b": 1000, "c": 1000}, {"a": 0.1, "b": 0.1, "c": 0.1}, 30)
    # No burst for b or the new c: each gets its third, within one task (b was last looked at one task ago).
    assert all(9 <= picks.count(n) <= 11 for n in "abc"), picks
    assert picks[:3].count("b") <= 2


def test_subqueue_settings_are_checked():
    settings = load_settings({}, {"queue_prefix": "p", "subqueue_weights": {"batch": {"acme": 3}}})
    assert settings.subqueue_weight("p.batch.acme") == 3.0
    assert settings.subqueue_weight("p.batch.other") == 1.0
    assert settings.tier_for_queue("p.batch.acme") is Tier.BATCH
    assert settings.tier_for_queue("p.offline.promoted") is Tier.OFFLINE
    assert settings.subqueue_cap(Tier.BATCH) == 100_000  # the tier's cap unless prio_subqueue_max_length says
    with pytest.raises(ConfigError, match=r"sub-queue name 'a b' must be 1-64 letters"):
        load_settings({}, {"subqueue_weights": {"batch": {"a b": 1}}})
    with pytest.raises(ConfigError, match="reserved"):
        load_settings({}, {"subqueue_weights": {"batch": {"promoted": 1}}})
    with pytest.raises(ConfigError, match="prio_subqueue_key must be a callable"):
        load_settings({}, {"subqueue_key": 42})
    with pytest.raises(ConfigError, match=r"prio_subqueue_max_length\[batch\] must be an int"):
        load_settings({}, {"subqueue_max_length": {"batch": 0}})


def test_a_queue_found_empty_once_and_not_reported_since_is_lifted_when_ordered():
    """A fetch that knows a queue is empty without asking it (Redis's ready index) stops reporting it on every
    fetch: ordering lifts it instead, so it comes back level with the busy queues, with no credit banked."""
    shares = QueueShares(lambda name: 1.0)
    shares.empty("b")  # found empty once ...
    for _ in range(500):  # ... then never reported again while a runs 500 tasks
        shares.finished("a", 0.1, shares.dispatched("a"))
    picks = []
    backlog = {"a": 1000, "b": 1000}
    for _ in range(20):
        name = shares.order(backlog, lift_idle=True)[0]
        shares.finished(name, 0.1, shares.dispatched(name))
        picks.append(name)
    assert 9 <= picks.count("b") <= 11, picks  # its half, not 20 in a row
    # Without the lift, b would have banked 500 tasks of credit while it had nothing to run.
    stale = QueueShares(lambda name: 1.0)
    stale.empty("b")
    for _ in range(500):
        stale.finished("a", 0.1, stale.dispatched("a"))
    assert stale.order(backlog)[:1] == ["b"] and stale.queues["b"].vtime < stale.queues["a"].vtime - 10


def test_the_asking_order_of_one_queue_lifts_it_as_ordering_would():
    """A take with one queue of a tier that may have work does not order it (``ServedQueues.asking_order``):
    the answer and the effect on the shares are those of ordering it."""
    from celery_prio.policy.served import ServedQueues

    prio = load_settings({"prio_queue_prefix": "aso"})
    batch, a, b = prio.queue_name(Tier.BATCH), prio.subqueue_name(Tier.BATCH, "a"), prio.subqueue_name(Tier.BATCH, "b")
    served = ServedQueues(prio, [batch])
    served.set_discovered([a, b])
    shares = served.shares[Tier.BATCH]
    shares.empty(a)  # found empty once, then not reported while b runs
    for _ in range(50):
        shares.finished(b, 0.1, shares.dispatched(b))
    assert shares.queues[a].idle
    assert served.asking_order(Tier.BATCH, {a}) == [a]
    assert not shares.queues[a].idle and shares.queues[a].vtime >= shares.queues[b].vtime - 0.1  # lifted level
    several = {batch, a, b}  # more than one: ordered as ``candidates`` orders them (its front lane left out)
    expected = [c.name for c in served.candidates(Tier.BATCH, several.__contains__) if c.name in several]
    assert served.asking_order(Tier.BATCH, several) == expected and len(expected) == 3
