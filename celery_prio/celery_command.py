"""``celery -A app prio ...``: operations on the tier queues.

celery -A app prio status [--json]          depth, dead letters and counters per tier
celery -A app prio dead list [--limit N]    messages evicted by drop_oldest
celery -A app prio dead requeue [--limit N] put them back (stops at a full tier)
celery -A app prio dead purge               delete them
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from .brokers import adapter_for
from .install import settings_for
from .tiers import TIERS


def _context(ctx):
    app = ctx.obj.app
    settings = settings_for(app)
    return app, settings, adapter_for(app)


@click.group(cls=click.Group, help="celery-prio: tier queues, dead letters, status.")
@click.pass_context
@handle_preload_options
def prio(ctx, **kwargs):
    """Operate celery-prio's tier queues."""


@prio.command(cls=CeleryCommand)
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def status(ctx, as_json: bool):
    """Queue depth per tier, as the broker reports it."""
    _, settings, adapter = _context(ctx)
    try:
        rows = {
            t.label: {
                "queue": settings.queue_name(t),
                "depth": adapter.depth(settings.queue_name(t)),
                "max_length": settings.max_length[t],
                "overflow": settings.overflow[t],
            }
            for t in TIERS
        }
        dead = adapter.depth(settings.dead_letter_queue)
    finally:
        adapter.close()
    if as_json:
        click.echo(json.dumps({"tiers": rows, "dead": dead}))
        return
    click.echo(f"{'tier':<10}{'queue':<28}{'depth':>9}{'max':>10}  overflow")
    for label, row in rows.items():
        click.echo(f"{label:<10}{row['queue']:<28}{row['depth']:>9}{row['max_length'] or '-':>10}  {row['overflow']}")
    click.echo(f"dead letters ({settings.dead_letter_queue}): {dead}")


@prio.group()
def dead():
    """Messages evicted from a full drop_oldest tier."""


@dead.command("list", cls=CeleryCommand)
@click.option("--limit", cls=CeleryOption, type=int, default=100, help="Show at most N, oldest first.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def dead_list(ctx, limit: int, as_json: bool):
    _, settings, adapter = _context(ctx)
    try:
        entries = adapter.dead_list(settings, limit)
    finally:
        adapter.close()
    if as_json:
        click.echo(json.dumps(entries))
        return
    for e in entries:
        when = datetime.fromtimestamp(e["at"], UTC).isoformat(timespec="seconds") if e["at"] else "?"
        click.echo(f"{e['id']}  {e['task']}  from {e['queue']}  {e['reason']}  at {when}")
    click.echo(f"{len(entries)} shown")


@dead.command("requeue", cls=CeleryCommand)
@click.option("--limit", cls=CeleryOption, type=int, default=None, help="Requeue at most N.")
@click.pass_context
def dead_requeue(ctx, limit: int | None):
    _, settings, adapter = _context(ctx)
    try:
        moved, left = adapter.dead_requeue(settings, limit)
    finally:
        adapter.close()
    click.echo(f"requeued {moved}; {left} left in {settings.dead_letter_queue}")


@dead.command("purge", cls=CeleryCommand)
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help="Do not ask.")
@click.pass_context
def dead_purge(ctx, force: bool):
    _, settings, adapter = _context(ctx)
    try:
        if not force:
            click.confirm(f"Delete every message in {settings.dead_letter_queue}?", abort=True)
        count = adapter.dead_purge(settings)
    finally:
        adapter.close()
    click.echo(f"purged {count} from {settings.dead_letter_queue}")
