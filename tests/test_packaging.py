"""What `pip install celery-prio` puts on a machine, and the entry points a newcomer runs first."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Without build isolation when setuptools is at hand (no download); pip fetches it otherwise.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("celery_prio-*.whl")
    return built


def test_the_wheel_installs_only_celery_prio(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    # No top-level "tasks" or "config": names many Celery apps use for their own modules.
    assert {t for t in top if not t.endswith(".dist-info")} == {"celery_prio"}
    assert "celery_prio/example/weights/digits_cnn.pt" in names  # the demo runs from a plain install
    assert "celery_prio/tools/demo.py" in names
    assert "celery_prio/brokers/redis/lua/fetch.lua" in names  # the Redis scripts are package data
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "celery-prio = celery_prio.ops.cli:main" in text and "prio = celery_prio.ops.celery_command:prio" in text


def test_the_library_never_imports_the_example_the_tools_or_torch():
    code = (
        "import sys, celery_prio, celery_prio.worker.consumer, celery_prio.ops.celery_command, "
        "celery_prio.worker.metrics, celery_prio.ops.cli; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith(('celery_prio.example', 'celery_prio.tools'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("hide", "argv", "message"),
    [
        (
            "rich",
            "['demo']",
            "celery-prio demo needs the 'demo' extra: pip install 'celery-prio[demo]' (missing: rich)",
        ),
        ("torch", None, "python -m celery_prio.example.train needs the 'demo' extra"),
    ],
)
def test_a_missing_extra_is_named_instead_of_a_traceback(hide, argv, message):
    run = (
        f"from celery_prio.ops.cli import main; sys.exit(main({argv}))"
        if argv
        else "import runpy; runpy.run_module('celery_prio.example.train', run_name='__main__')"
    )
    code = f"import sys; sys.modules[{hide!r}] = None; {run}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_training_the_example_model_as_documented(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "weights.pt"
    done = subprocess.run(
        [sys.executable, "-m", "celery_prio.example.train", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.split("held-out accuracy ")[1].split()[0])
    assert accuracy >= 0.95 and out.stat().st_size > 10_000
