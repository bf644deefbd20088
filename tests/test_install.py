"""``install()`` against an app's own configuration, before and after it (no broker connection needed)."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

import celery_prio
from celery_prio.errors import ConfigError
from celery_prio.install import CONSUMER_PATH, ensure_installed, replaced_settings
from celery_prio.runtime import runtime_of
from celery_prio.worker.consumer import PrioConsumer


def make(**conf) -> Celery:
    app = Celery("adopting", broker="redis://127.0.0.1:6379/15", set_as_current=False)
    app.conf.update(conf)
    return app


def test_a_misspelt_setting_under_a_config_namespace_is_refused_with_its_right_name():
    class Config:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/15"
        CELERY_PRIO_MAX_LENGHT = {"realtime": 3}

    app = Celery("adopting", set_as_current=False)
    app.config_from_object(Config, namespace="CELERY")
    with pytest.raises(ConfigError, match="'CELERY_PRIO_MAX_LENGHT'; did you mean 'CELERY_PRIO_MAX_LENGTH'"):
        celery_prio.install(app)


def test_a_namespaced_setting_spelt_right_is_read():
    class Config:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/15"
        CELERY_PRIO_MAX_LENGTH = {"realtime": 3}

    app = Celery("adopting", set_as_current=False)
    app.config_from_object(Config, namespace="CELERY")
    assert celery_prio.install(app).max_length[celery_prio.Tier.REALTIME] == 3


def test_install_says_what_it_changed():
    app = make(task_default_queue="jobs")
    celery_prio.install(app)
    changes = "; ".join(runtime_of(app).changes)
    assert "task_default_queue 'jobs' -> 'prio.batch'" in changes
    assert f"worker_consumer 'celery.worker.consumer:Consumer' -> '{CONSUMER_PATH}'" in changes
    assert "unacked_key" in changes and "priority_steps" in changes
    assert "also drain jobs while it holds messages (prio_legacy_queues)" in changes
    assert runtime_of(app).legacy_queues == ("jobs",)


def test_routes_and_transport_options_assigned_after_install_are_merged_back_and_named(caplog):
    app = make()
    celery_prio.install(app, max_length={"realtime": 2})
    own_route = {"jobs.*": {"queue": "jobs"}}
    app.conf.task_routes = own_route
    app.conf.broker_transport_options = {"visibility_timeout": 100}
    assert replaced_settings(app, runtime_of(app)) == ["task_routes", "broker_transport_options"]
    caplog.set_level(logging.WARNING, logger="celery_prio.install")
    ensure_installed(app)
    routes = app.conf.task_routes
    assert getattr(routes[0], "celery_prio", False) and routes[1] == own_route
    options = app.conf.broker_transport_options
    assert options["visibility_timeout"] == 100 and options["prio_caps"]["prio.realtime"][0] == 2
    assert "app.conf.task_routes, app.conf.broker_transport_options were replaced" in caplog.text
    assert replaced_settings(app, runtime_of(app)) == []


def test_a_config_reloaded_after_install_gets_install_back_with_the_overrides():
    app = make()
    celery_prio.install(app, queue_prefix="mine")
    app.config_from_object({"result_expires": 60})
    assert ensure_installed(app).queue_prefix == "mine"
    assert app.conf.worker_consumer == CONSUMER_PATH and app.conf.task_default_queue == "mine.batch"
    assert {q.name for q in app.conf.task_queues} >= {"mine.realtime", "mine.batch", "mine.offline"}


def test_an_own_default_queue_set_after_install_is_kept():
    app = make()
    celery_prio.install(app)
    app.conf.task_default_queue = "jobs"
    ensure_installed(app)
    assert app.conf.task_default_queue == "jobs"


class OwnConsumer:
    """Not a PrioConsumer."""


def test_an_own_consumer_before_install_is_refused_naming_the_setting():
    app = make(worker_consumer=f"{__name__}:OwnConsumer")
    with pytest.raises(ConfigError, match=r"worker_consumer is set to '.*OwnConsumer' before celery_prio.install\(\)"):
        celery_prio.install(app)


class OwnPrioConsumer(PrioConsumer):
    """The app's own consumer, built on celery-prio's."""


def test_a_prio_consumer_subclass_is_accepted():
    app = make(worker_consumer="celery_prio.worker.consumer:PrioConsumer")
    celery_prio.install(app)
    assert app.conf.worker_consumer == CONSUMER_PATH


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_own_prio_consumer_subclass_is_kept(when):
    """Accepted is kept: install() and its re-application at worker start leave the app's subclass in place."""
    own = f"{__name__}:OwnPrioConsumer"
    app = make(worker_consumer=own) if when == "before" else make()
    celery_prio.install(app)
    if when == "after":
        app.conf.worker_consumer = own
    ensure_installed(app, worker=True)
    assert app.conf.worker_consumer == own
    assert "worker_consumer" not in replaced_settings(app, runtime_of(app))
