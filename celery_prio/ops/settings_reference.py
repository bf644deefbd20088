"""The settings reference page (``docs/reference/settings.md``), generated from the settings table.

``python -m celery_prio.ops.settings_reference docs/reference/settings.md``
writes it; ``tests/test_docs.py`` fails when the page and the table differ,
so the reference always shows the code's names, defaults and meanings.
"""

from __future__ import annotations

import json

from ..settings.table import GROUPS, SETTINGS, Setting
from .reference_page import table_section, write_page

INTRO = """# Settings reference

Celery settings with a `prio_` prefix, or `install(app, name=value)` without
it. Per-tier settings take a dict keyed by tier name or alias; tiers not
given keep their defaults. Every value is validated at `install()` and at
worker start; an error names the setting and the value. A `prio_` key that
is not a setting is refused with the nearest valid name (`unknown celery-prio
setting 'prio_max_lenght'; did you mean 'prio_max_length'?`), and a worker
refuses to start while a task declares a tier that does not exist
(`@app.task(tier="nope")`).

This page is generated from the table in `celery_prio/settings/table.py`
(`python -m celery_prio.ops.settings_reference docs/reference/settings.md`).
"""


def shown_default(setting: Setting) -> str:
    """The default as the reference shows it: Python's words for None/True/False, JSON for the rest."""
    if setting.shown is not None:
        value, _, note = setting.shown.partition(" ")
        return f"`{value}` {note}".rstrip()
    default = setting.default
    if default is None or isinstance(default, bool):
        return f"`{default}`"
    return "`" + json.dumps(default).replace("null", "None") + "`"


def markdown() -> str:
    out = [INTRO]
    for group in GROUPS:
        rows = [f"| `prio_{s.name}` | {shown_default(s)} | {s.doc} |" for s in SETTINGS if s.group == group]
        out += table_section(group, ["setting", "default", "meaning"], rows)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return write_page(markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
