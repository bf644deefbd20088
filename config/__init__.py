"""Celery configuration for the example app (``config.celery``), read from the environment."""
