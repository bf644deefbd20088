"""The installable artifact (issue 38): ``python -m build`` makes a wheel and an sdist that pass ``twine check``,
with the typing marker, the Redis scripts and the example's weights inside; the wheel, installed into a fresh
virtualenv the way the README shows (the CPU torch wheel first), runs ``celery-prio demo``."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], check=True, capture_output=True)
    return out


def test_the_wheel_and_the_sdist_pass_twine_check_and_carry_what_runs(dist):
    wheel, sdist = next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))
    checked = subprocess.run([sys.executable, "-m", "twine", "check", str(wheel), str(sdist)], capture_output=True)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    names = zipfile.ZipFile(wheel).namelist()
    assert "celery_prio/py.typed" in names  # PEP 561: type checkers read the package's annotations
    assert "celery_prio/brokers/redis/lua/fetch.lua" in names  # read at import
    assert any(n.startswith("celery_prio/example/weights/") for n in names)
    assert not any(n.startswith(("tests/", "tasks/", "config/")) for n in names)  # an app's names, not ours
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Python: >=3.11" in text and "Typing :: Typed" in text and "License-Expression: Apache-2.0" in text


def test_the_wheel_installed_in_a_fresh_virtualenv_runs_the_demo(dist, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    pip, wheel = env / "bin" / "pip", next(dist.glob("*.whl"))
    installed = subprocess.run(
        [str(pip), "install", "-q", "torch==2.13.0", f"{wheel}[demo]"], capture_output=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr.decode()[-3000:]
    demo = subprocess.run(
        [str(env / "bin" / "celery-prio"), "demo", "--duration", "5"],
        capture_output=True,
        timeout=400,
        cwd=tmp_path,  # not the checkout: nothing of it on the path
    )
    out = demo.stdout.decode() + demo.stderr.decode()
    assert demo.returncode == 0, out[-4000:]
    assert "realtime P99: FIFO" in out and "celery-prio" in out
