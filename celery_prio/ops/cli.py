"""``celery-prio``: the demo and the benchmark (their code lives in ``celery_prio.tools``)."""

from __future__ import annotations

import importlib
import sys

from ..extras import require

#: command -> (module, extra it needs or None)
COMMANDS = {"demo": ("celery_prio.tools.demo", "demo"), "bench": ("celery_prio.tools.bench", None)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: celery-prio {" + ",".join(COMMANDS) + "} [options]\n"
            "  demo    the torch example under FIFO, then under celery-prio (needs the 'demo' extra)\n"
            "  bench   plain Celery vs celery-prio, side by side (celery-prio bench --help)"
        )
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    module_name, extra = COMMANDS[argv[0]]
    if extra is not None:
        require(extra, f"celery-prio {argv[0]}")
    return importlib.import_module(module_name).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
