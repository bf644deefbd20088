"""Settings and tier parsing: every bad value fails with a message naming it."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_prio
from celery_prio import ConfigError, Tier, parse_tier
from celery_prio.policy.routes import check_task_tiers
from celery_prio.settings import load_settings


@pytest.mark.parametrize(
    ("raw", "tier"),
    [
        ("realtime", Tier.REALTIME),
        ("P0", Tier.REALTIME),
        (0, Tier.REALTIME),
        ("batch", Tier.BATCH),
        ("p1", Tier.BATCH),
        (1, Tier.BATCH),
        ("offline", Tier.OFFLINE),
        ("2", Tier.OFFLINE),
        (Tier.OFFLINE, Tier.OFFLINE),
    ],
)
def test_tier_aliases(raw, tier):
    assert parse_tier(raw) is tier


@pytest.mark.parametrize("raw", ["urgent", 3, -1, None, True, 1.5, "p3", ""])
def test_unknown_tier_names_the_valid_ones(raw):
    with pytest.raises(ValueError, match=r"valid tiers: realtime\|batch\|offline"):
        parse_tier(raw)


def test_defaults():
    s = load_settings({})
    assert s.weights == {Tier.REALTIME: 8, Tier.BATCH: 2, Tier.OFFLINE: 1}
    assert s.min_share == 5
    assert s.queue_name(Tier.REALTIME) == "prio.realtime"
    assert s.aging[Tier.OFFLINE] == 1800 and s.aging[Tier.REALTIME] is None
    assert s.overflow[Tier.OFFLINE] == "drop_oldest" and s.overflow[Tier.REALTIME] == "reject"
    assert s.effective_reserve(4) == 1 and s.effective_reserve(1) == 0


def test_per_tier_dicts_accept_aliases_and_merge_over_defaults():
    s = load_settings({"prio_weights": {"p0": 10}}, {"aging": {2: 60}})
    assert s.weights[Tier.REALTIME] == 10 and s.weights[Tier.BATCH] == 2
    assert s.aging[Tier.OFFLINE] == 60


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"weights": {"realtime": 0}}, r"prio_weights must be a number > 0, got 0"),
        ({"weights": {"batch": -2}}, r"prio_weights must be a number > 0, got -2"),
        ({"weights": {"urgent": 3}}, r"prio_weights: unknown tier 'urgent'"),
        ({"weights": [8, 2, 1]}, r"prio_weights must be a dict keyed by tier"),
        ({"reserve": -1}, r"prio_reserve must be a whole number >= 0"),
        ({"boost_timeout": 0}, r"prio_boost_timeout must be a number > 0, got 0"),
        ({"boost_memory": -1}, r"prio_boost_memory must be a whole number >= 0, got -1"),
        ({"boost_memory": 2.5}, r"prio_boost_memory must be a whole number >= 0, got 2.5"),
        ({"trace_file": ""}, r"prio_trace_file must be a file path or None, got ''"),
        ({"trace_max": -3}, r"prio_trace_max must be a whole number >= 0, got -3"),
        ({"demand_target": {"realtime": -1}}, r"prio_demand_target\[realtime\] must be a number > 0, got -1"),
        ({"min_share": 101}, r"prio_min_share is a percentage"),
        ({"aging": {"offline": -5}}, r"prio_aging\[offline\] must be a number >= 0, got -5"),
        ({"aging": {"batch": "soon"}}, r"prio_aging\[batch\] must be a number >= 0, got 'soon'"),
        ({"aging": {"realtime": -5}}, r"prio_aging\[realtime\] must be a number >= 0, got -5"),
        ({"aging": {"offline": float("nan")}}, r"prio_aging\[offline\] must be a number >= 0"),
        ({"management_url": "15672"}, r"prio_management_url must be an http:// or https:// URL"),
        ({"max_length": {"realtime": 0}}, r"prio_max_length\[realtime\] must be an int >= 1"),
        ({"overflow": {"offline": "drop_newest"}}, r"prio_overflow\[offline\] must be one of"),
        ({"queue_prefix": ""}, r"prio_queue_prefix must be a non-empty string"),
        ({"default_tier": "urgent"}, r"prio_default_tier: unknown tier 'urgent'"),
        ({"routes": {"app.*": "p9"}}, r"prio_routes\['app.\*'\]: unknown tier 'p9'"),
        ({"scheduler": "fifo"}, r"prio_scheduler must be one of"),
        ({"idle_share": "spread"}, r"prio_idle_share must be one of \('proportional', 'next_below'\), got 'spread'"),
        ({"slice": {"realtime": 0.1}}, r"prio_slice\[realtime\] must be None: realtime never yields"),
        ({"slice": {"batch": 0}}, r"prio_slice\[batch\] must be a number > 0"),
        ({"realtime_target": 0}, r"prio_realtime_target must be a number > 0"),
        ({"realtime_target": "fast"}, r"prio_realtime_target must be a number > 0"),
        ({"poll_interval": 0}, r"prio_poll_interval must be a number > 0"),
        ({"gpus": "0,one"}, r"prio_gpus and CELERY_PRIO_GPUS take GPU numbers like 0,1; got '0,one'"),
        ({"gpus": {"realtime": 0}}, r"prio_gpus and CELERY_PRIO_GPUS take GPU numbers like 0,1"),
        ({"management_url": "http://m1:15672;m2:15672"}, r"several, ';'-separated"),
        ({"wieghts": {}}, r"unknown celery-prio setting 'wieghts'; did you mean 'prio_weights'\?"),
    ],
)
def test_bad_settings_name_the_setting_and_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings({}, overrides)


def test_bad_setting_in_celery_conf_fails_at_install():
    app = Celery("t", set_as_current=False)
    app.conf.prio_weights = {"realtime": 0}
    with pytest.raises(ConfigError, match="prio_weights"):
        celery_prio.install(app)


def test_misspelt_prio_key_in_celery_conf_names_the_nearest_setting():
    app = Celery("t", set_as_current=False)
    app.conf.prio_max_lenght = {"realtime": 5}
    with pytest.raises(
        ConfigError, match=r"unknown celery-prio setting 'prio_max_lenght'; did you mean 'prio_max_length'"
    ):
        celery_prio.install(app)


def test_realtime_aging_is_accepted_but_never_applies():
    assert load_settings({}, {"aging": {"realtime": 30}}).aging[Tier.REALTIME] is None


def test_a_task_with_a_bogus_tier_is_refused_by_the_worker_check():
    app = Celery("t", broker="redis://127.0.0.1:6379/13", set_as_current=False)
    celery_prio.install(app)

    @app.task(shared=False, name="t.bogus", tier="nope")
    def bogus():
        return None

    with pytest.raises(
        ConfigError, match=r"task 't.bogus': unknown tier 'nope'; valid tiers: realtime\|batch\|offline"
    ):
        check_task_tiers(app.tasks)


def test_reserve_must_be_below_concurrency():
    s = load_settings({}, {"reserve": 4})
    assert s.effective_reserve(8) == 4
    with pytest.raises(ConfigError, match=r"prio_reserve=4 must be below the worker concurrency \(4\)"):
        s.effective_reserve(4)


def test_route_patterns():
    s = load_settings({}, {"routes": {"ml.online.*": "realtime", "ml.*": "offline"}})
    assert s.tier_for_task_name("ml.online.classify") is Tier.REALTIME
    assert s.tier_for_task_name("ml.report") is Tier.OFFLINE
    assert s.tier_for_task_name("billing.charge") is None


UP = ("u", "p")
PLAIN = (
    "the broker's credentials are not sent over plain HTTP to {}: use an https:// prio_management_url, put "
    "management credentials in that URL, or set prio_management_plain_http=True to send them anyway"
)


@pytest.mark.parametrize(
    ("broker", "management_url", "tls", "expected"),
    [
        # plain HTTP off this host: the broker's credentials are withheld, and why is said
        (
            "amqp://u:p@rabbit:5672//",
            None,
            False,
            ("http://rabbit:15672", "/", (None,), PLAIN.format("http://rabbit:15672")),
        ),
        ("amqp://u:p@localhost:5672//", None, False, ("http://localhost:15672", "/", (UP,), None)),  # loopback
        ("amqps://u:p@rabbit:5671/prod", None, False, ("https://rabbit:15671", "prod", (UP,), None)),
        ("amqp://u:p@rabbit:5672//", None, True, ("https://rabbit:15671", "/", (UP,), None)),
        ("amqp://rabbit//", None, False, ("http://rabbit:15672", "/", (None,), None)),  # no guest fallback
        (
            "amqp://u:p@rabbit//",
            "https://ops:s3cret@mgmt.example:443/rmq",
            False,
            ("https://mgmt.example:443/rmq", "/", (("ops", "s3cret"),), None),
        ),
        ("amqp://u:p@rabbit//", "https://mgmt.example", False, ("https://mgmt.example", "/", (UP,), None)),
        # the case: a TLS broker and a plain-HTTP management URL: withheld
        (
            "amqps://u:p@rabbit//",
            "http://mgmt.example:15672",
            False,
            ("http://mgmt.example:15672", "/", (None,), PLAIN.format("http://mgmt.example:15672")),
        ),
        # a cluster: every failover host, once, in order
        (
            "amqps://u:p@r1:5671//;amqps://u:p@r2:5671//;amqps://u:p@r1:5673//",
            None,
            False,
            ("https://r1:15671;https://r2:15671", "/", (UP, UP), None),
        ),
        # each endpoint its own credentials, never another's
        (
            "amqp://u:p@r1//",
            "https://m1:15671; https://ops:pw@m2:15671/",
            False,
            ("https://m1:15671;https://m2:15671/", "/", (UP, ("ops", "pw")), None),
        ),
    ],
)
def test_management_endpoint_follows_the_broker_tls_and_never_defaults_credentials(
    broker, management_url, tls, expected
):
    from celery_prio.brokers.amqp.management import management_endpoint

    assert management_endpoint(broker, management_url, tls=tls) == expected


def test_plain_http_sends_the_broker_credentials_only_when_a_setting_says_so():
    from celery_prio.brokers.amqp.management import management_endpoint

    assert management_endpoint("amqp://u:p@rabbit//", None, plain_http=True)[2:] == ((UP,), None)
    assert load_settings({}).management_plain_http is False
    with pytest.raises(ConfigError, match="prio_management_plain_http"):
        load_settings({}, {"management_plain_http": "yes"})


def test_inspect_conf_masks_the_management_url():
    from celery import Celery
    from celery.app.utils import filter_hidden_settings

    import celery_prio

    app = Celery("masked", broker="amqp://u:p@localhost//")
    celery_prio.install(app, management_url="https://ops:s3cret@mgmt.example")
    shown = filter_hidden_settings(app.conf.table(with_defaults=False))
    assert "s3cret" not in repr(shown) and shown["prio_management_url"] == "********"
