"""The README and the docs site stay true to the code and to CI.

The README opens with the two commands (the second is what ``.ci/run``
runs) and stays short; the settings reference is exactly what the settings
table generates; every page is in the site's navigation and every link
between pages points at a page that exists; the site builds with
``mkdocs build --strict``, with an API page that renders every export's docstring.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

import celery_prio
from celery_prio.ops.settings_reference import markdown
from celery_prio.settings import DEFAULTS, documented_settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference" / "settings.md"


def test_the_two_commands_come_first_and_match_ci():
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    assert "celery-prio demo" in commands[0] and commands[1].endswith("&& pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    install = commands[1].split("&& ")[2]
    assert install.strip() in ci and "\npytest\n" in ci


def test_the_readme_is_short_and_points_into_the_docs():
    assert len(README.splitlines()) <= 350
    links = re.findall(r"\]\((docs/[^)#]+)", README)
    assert links, "the README links into docs/"
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_the_settings_reference_is_generated_from_the_table():
    assert REFERENCE.read_text() == markdown(), (
        "docs/reference/settings.md is out of date: "
        "python -m celery_prio.ops.settings_reference docs/reference/settings.md"
    )


def test_the_metrics_reference_is_generated_from_the_collectors():
    from celery_prio.ops.metrics_reference import markdown as metrics_markdown

    assert (ROOT / "docs" / "reference" / "metrics.md").read_text() == metrics_markdown(), (
        "docs/reference/metrics.md is out of date: "
        "python -m celery_prio.ops.metrics_reference docs/reference/metrics.md"
    )


def test_the_cli_reference_is_generated_from_the_commands():
    from celery_prio.ops.cli_reference import markdown as cli_markdown

    assert (ROOT / "docs" / "reference" / "cli.md").read_text() == cli_markdown(), (
        "docs/reference/cli.md is out of date: python -m celery_prio.ops.cli_reference docs/reference/cli.md"
    )


def _reference_rows() -> dict[str, str]:
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        match = re.match(r"\| `(prio_[a-z_]+)` \| `(.*?)`", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_the_reference_lists_every_setting_and_no_other():
    assert sorted(_reference_rows()) == sorted(documented_settings())


def test_the_reference_shows_the_real_defaults():
    for name, shown in _reference_rows().items():
        default = DEFAULTS[name.removeprefix("prio_")]
        if isinstance(default, dict) and default:
            assert json.loads(shown.replace("None", "null")) == json.loads(json.dumps(default)), name
        elif default is None:
            assert shown == "None", name
        else:
            assert shown.strip('"') == str(default), name


def _nav_pages(entries) -> list[str]:
    out = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_navigation_and_every_link_resolves():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    broken = []
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).resolve().exists():
                broken.append((str(page.relative_to(DOCS)), target))
    assert broken == []


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(  # mkdocs and its Material theme come with the test extra
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").is_file()
    # The API page is rendered from the docstrings by mkdocstrings: every exported name gets its own entry
    # (an anchor with its name and a docstring), so a new export without one fails here.
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    missing = [name for name in celery_prio.__all__ if f'id="celery_prio.{_defined_in(name)}.{name}"' not in api]
    assert missing == [], f"not on the API page: {missing}"
    text = re.sub(r"<[^>]+>", "", api)
    assert not re.search(r":(func|class|meth|data|attr):", text), "a Sphinx role the API page shows raw"
    for name in celery_prio.__all__:
        doc = inspect.getdoc(getattr(celery_prio, name)) if name != "TIERS" else "TIERS"
        assert doc and "Built-in" not in doc, f"celery_prio.{name} has no docstring of its own"


def _defined_in(name: str) -> str:
    obj = getattr(celery_prio, name)
    module = "celery_prio.tiers" if name == "TIERS" else obj.__module__
    return module.removeprefix("celery_prio.")
