"""What the generated reference pages share: ``python -m <generator> [path]`` writes the page, or prints it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def write_page(markdown: Callable[[], str], argv: list[str] | None = None) -> int:
    """Write ``markdown()`` to the path in ``argv`` (or the command line), else to stdout."""
    args = sys.argv[1:] if argv is None else argv
    text = markdown()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def table_section(title: str, columns: list[str], rows: list[str]) -> list[str]:
    """The lines of one ``## title`` section holding a table with ``columns`` and its ``rows``."""
    return [f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, ""]
