"""The command-line reference page (``docs/reference/cli.md``), generated from the commands' own definitions.

``python -m celery_prio.ops.cli_reference docs/reference/cli.md`` writes it; ``tests/test_docs.py`` fails
when the page and the commands differ. ``celery -A app prio ...`` is a click group (its help as click renders
it); ``celery-prio demo`` and ``celery-prio bench`` are argparse parsers (their ``--help``).
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import click

from .celery_command import prio
from .reference_page import write_page

#: Help texts are wrapped at this width, whatever the terminal the page is generated on.
WIDTH = 100

INTRO = """# Command-line reference

Two entry points. `celery -A app prio …` is a Celery subcommand (installed
with the package; it takes Celery's own `-A`, `-b` options before `prio`):
operators' views and actions on a running fleet. `celery-prio …` runs the
demo and the benchmarks. The worker itself is `celery -A app worker` as
always, with one more option, `--prio-gpus` ([Workers on GPUs](../guides/gpus.md)).

This page is generated from the commands' definitions
(`python -m celery_prio.ops.cli_reference docs/reference/cli.md`).
"""


def _click_pages(command: click.Command, path: str, parent: click.Context | None = None) -> list[tuple[str, str]]:
    ctx = click.Context(
        command, info_name=path.split()[-1], parent=parent, terminal_width=WIDTH, max_content_width=WIDTH
    )
    pages = [(path, command.get_help(ctx))]
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            pages += _click_pages(command.commands[name], f"{path} {name}", ctx)
    return pages


def _argparse_help(main: Any) -> str:
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue()


def markdown() -> str:
    from ..tools import bench, demo

    out = [INTRO, "## celery -A app prio", ""]
    root = click.Context(click.Group("celery"), info_name="celery", terminal_width=WIDTH, max_content_width=WIDTH)
    for path, text in _click_pages(prio, "celery prio", root):
        out += [f"### `{path}`", "", "```text", text.rstrip(), "```", ""]
    out += ["## celery-prio", ""]
    for name, module in (("demo", demo), ("bench", bench)):
        out += [f"### `celery-prio {name}`", "", "```text", _argparse_help(module.main).rstrip(), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return write_page(markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
