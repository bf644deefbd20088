"""Celery configuration for the example app, read from the environment."""
