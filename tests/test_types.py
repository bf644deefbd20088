"""``mypy --strict`` on the parts whose types are the contract: the pure policy, the settings, the broker
interfaces and the per-app runtime. (Celery, kombu and redis-py carry no complete types: their names are
``Any`` to mypy; ``[tool.mypy]`` in pyproject.toml.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STRICT = [
    "celery_prio/policy",
    "celery_prio/settings",
    "celery_prio/brokers/base.py",
    "celery_prio/brokers/publishing.py",
    "celery_prio/runtime.py",
    "celery_prio/tiers.py",
    "celery_prio/errors.py",
]


@pytest.mark.timeout(300)
def test_the_typed_core_passes_mypy_strict():
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", *STRICT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
