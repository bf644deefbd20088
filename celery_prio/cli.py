"""``celery-prio``: the demo and the benchmark."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "celery_prio.demo", "bench": "celery_prio.bench"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: celery-prio {" + ",".join(commands) + "} [options]\n"
            "  bench   plain Celery vs celery-prio, side by side (celery-prio bench --help)"
        )
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
