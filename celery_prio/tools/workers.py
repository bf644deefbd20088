"""Start and stop real ``celery worker`` processes (benchmarks, demo, tests).

Workers run in their own process group so that stopping one also stops its
pool children: a benchmark or test that fails half-way leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

READY_MARK = "ready."


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """One ``celery -A <app> worker`` process, its log in a file."""

    def __init__(
        self,
        app: str,
        *,
        log_path: Path,
        concurrency: int = 4,
        pool: str = "prefork",
        queues: Sequence[str] | None = None,
        hostname: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
        python: str | None = None,
    ) -> None:
        self.log_path = Path(log_path)
        args = [
            python or sys.executable,  # another virtualenv's interpreter: a baseline that needs other packages
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-l",
            "INFO",
            "-c",
            str(concurrency),
            "-P",
            pool,
            "--without-mingle",
            "--without-gossip",
        ]
        if queues:
            args += ["-Q", ",".join(queues)]
        if hostname:
            args += ["-n", hostname]
        args += list(extra_args)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY_MARK in self.log():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"worker not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM): running tasks finish, then the worker exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the main process shuts its pool down
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # anything left of the group
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group: the worker and its pool children."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
