"""README.md stays true: its settings table lists exactly the code's settings, with their defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path

from celery_prio.settings import DEFAULTS, documented_settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def table_rows() -> dict[str, str]:
    rows = {}
    for line in README.splitlines():
        match = re.match(r"\| `(prio_[a-z_]+)` \| `?(.*?)`? \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_configuration_table_lists_every_setting_and_no_other():
    assert sorted(table_rows()) == sorted(documented_settings())


def test_configuration_table_shows_the_real_defaults():
    for name, shown in table_rows().items():
        default = DEFAULTS[name.removeprefix("prio_")]
        if isinstance(default, dict) and default:
            assert json.loads(shown.replace("None", "null")) == json.loads(json.dumps(default)), name
        elif default is None:
            assert shown.startswith("None"), name
        else:
            assert shown.strip('"') == str(default), name


def test_the_two_commands_come_first_and_match_ci():
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    assert "celery-prio demo" in commands[0] and commands[1].endswith("&& pytest")
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    install = commands[1].split("&& ")[2]
    assert install.strip() in ci and "\npytest\n" in ci
