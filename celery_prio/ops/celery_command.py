"""``celery -A app prio ...``: operations on the tier queues.

celery -A app prio status [--json]          depth, dead letters, counters and demand (slots needed) per tier
celery -A app prio exporter [--port 9809]   the same for Prometheus: celery_prio_demand_slots{tier} for autoscalers
celery -A app prio boost ID [--tier T]      lift a queued task into a higher tier
celery -A app prio simulate SPEC [--set k=v] replay a workload through the real scheduler, side by side
celery -A app prio dead list [--limit N]    evicted (drop_oldest) and malformed/unrunnable messages
celery -A app prio dead requeue [--limit N] put them back (stops at a full queue; only to this app's queues)
celery -A app prio dead purge               delete them
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from ..brokers import adapter_for
from ..errors import ConfigError
from ..runtime import settings_for
from ..worker.report import fmt
from .fleet import cluster_status


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
@click.option("--watch", cls=CeleryOption, type=float, default=None, help="Refresh every N seconds.")
@click.pass_context
def status(ctx, as_json: bool, watch: float | None):
    """Per tier: depth (from the broker), rates, waits and shares (from the workers)."""
    _, settings, adapter = _context(ctx)
    app = ctx.obj.app
    try:
        while True:
            data = cluster_status(app, settings, adapter)
            if as_json:
                click.echo(json.dumps(data))
            else:
                if watch:
                    click.clear()
                header = (
                    f"{'tier':<10}{'depth':>8}{'max':>9}{'workers':>9}{'dispatched':>12}{'running':>9}"
                    f"{'oldest s':>10}{'wait p99 ms':>13}{'share':>8}{'of':>7}{'yields':>8}{'boosted':>9}{'slice s':>9}"
                    f"{'demand':>8}"
                )
                click.echo(header)
                for label, r in data["tiers"].items():
                    click.echo(
                        f"{label:<10}{r['depth']:>8}{fmt(r['max_length']):>9}{r['workers']:>9}"
                        f"{r['dispatched']:>12}{r['running']:>9}{fmt(r['oldest_wait_s'], '{:.1f}'):>10}"
                        f"{fmt(r['wait_p99_ms'], '{:.0f}'):>13}{fmt(r['slot_time_share'], '{:.2f}'):>8}"
                        f"{r['configured_share']:>7.2f}{r['yields']:>8}{boosted_figure(r):>9}"
                        f"{fmt(r['slice_s'], '{:.2f}'):>9}{r['demand_slots']:>8}"
                    )
                if data["subqueues"]:
                    click.echo(
                        f"\n{'queue inside its tier':<40}{'depth':>8}{'dispatched':>12}{'share':>8}{'wait p99 ms':>13}"
                    )
                    for name, r in data["subqueues"].items():
                        click.echo(
                            f"{name:<40}{fmt(r['depth']):>8}{r['dispatched']:>12}"
                            f"{fmt(r['share_of_tier'], '{:.2f}'):>8}{fmt(r['wait_p99_ms'], '{:.0f}'):>13}"
                        )
                for label, r in data["tiers"].items():
                    if r.get("rejected") or r.get("refused_wait") or r.get("expired"):
                        click.echo(
                            f"REFUSED {label}: {r.get('rejected') or 0} at the cap, {r.get('refused_wait') or 0} "
                            f"over the wait budget (prio_max_wait); {r.get('expired') or 0} expired past the deadline"
                        )
                for label, r in data["tiers"].items():
                    if r.get("answered"):
                        click.echo(
                            f"ON TIME {label}: {r['on_time']} of {r['answered']} answered within "
                            f"prio_realtime_target ({settings.realtime_target:g} s), publish to done"
                        )
                for name, r in data["unserved"].items():
                    click.echo(f"UNSERVED {name}: {r['depth']} waiting, no live worker serves {r['tier']}")
                for name, r in data["legacy"].items():
                    click.echo(
                        f"LEGACY {name}: {r['depth']} waiting where producers without celery-prio publish; "
                        f"workers that serve {settings.default_tier.label} drain it"
                    )
                for worker, problem in data["discovery_problems"].items():
                    click.echo(f"DISCOVERY FAILING on {worker}: {problem}")
                click.echo(
                    f"dead letters ({settings.dead_letter_queue}): {data['dead']}; "
                    f"workers: {', '.join(data['workers']) or 'none answered'}"
                )
                for worker, gpus in data["worker_gpus"].items():
                    click.echo(f"GPUS {worker}: {','.join(gpus)} (one per pool process, in turn)")
            if not watch:
                break
            time.sleep(watch)
    finally:
        adapter.close()


def boosted_figure(row: dict) -> str:
    """Tasks boosted out of the tier (Redis counts them broker-wide), else boosted ones the workers ran."""
    return str(row["boosted"] if row.get("boosted") is not None else row.get("boosted_seen", 0))


@prio.command(cls=CeleryCommand)
@click.option("--port", cls=CeleryOption, type=int, default=9809, help="Serve /metrics on this port (9809).")
@click.option("--host", cls=CeleryOption, default="127.0.0.1", help="Address to listen on (0.0.0.0 in a pod).")
@click.pass_context
def exporter(ctx, port: int, host: str):
    """Serve the fleet's figures and the demand signal per tier to Prometheus (for KEDA or an HPA)."""
    from .fleet_metrics import serve_fleet_metrics

    app, settings, adapter = _context(ctx)
    adapter.close()
    serve_fleet_metrics(app, settings, host, port)
    click.echo(f"celery-prio: fleet metrics on http://{host}:{port}/metrics")
    while True:
        time.sleep(3600)


@prio.command(cls=CeleryCommand)
@click.argument("workload", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--set", "sets", cls=CeleryOption, multiple=True, help="An alternative setting, name=value (repeat).")
@click.option("--vs", cls=CeleryOption, multiple=True, help='Another alternative: "name=value name=value".')
@click.option("--workers", cls=CeleryOption, type=int, default=None, help="Workers (default: the workload's).")
@click.option("--concurrency", cls=CeleryOption, type=int, default=None, help="Slots per worker.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def simulate(ctx, workload: Path, sets, vs, workers, concurrency, as_json: bool):
    """Replay a workload (spec or recorded trace) through the real scheduler for these settings and others."""
    from ..settings import load_settings
    from .simulate import simulate as run_simulation
    from .workload import load_workload, parse_override

    app = ctx.obj.app
    try:
        spec = load_workload(workload, workers, concurrency)
        alternatives = {"app settings": {}}
        if sets:
            alternatives[" ".join(sets)] = dict(parse_override(x) for x in sets)
        for group in vs:
            alternatives[group] = dict(parse_override(x) for x in group.split())
        runs = {label: run_simulation(spec, load_settings(app.conf, o)) for label, o in alternatives.items()}
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(runs))
        return
    click.echo(
        f"{spec.workers} worker(s) x {spec.concurrency} slots, {spec.duration:g} s of arrivals "
        f"(+{spec.grace:g} s), {spec.overhead_s * 1000:g} ms dispatch overhead"
    )
    rows = (
        ("wait p50 ms", "wait_p50_ms", "{:.0f}"),
        ("wait p99 ms", "wait_p99_ms", "{:.0f}"),
        ("latency p99 ms", "latency_p99_ms", "{:.0f}"),
        ("share of slot time", "slot_time_share", "{:.2f}"),
        ("longest wait s", "longest_wait_s", "{:.1f}"),
        ("completed / arrived", None, None),
        ("promoted", "promoted", "{}"),
        ("yields", "yields", "{}"),
        ("refused (429 wait)", "refused", "{}"),
        ("expired (deadline)", "expired", "{}"),
        ("on time (target)", "on_time", "{}"),
    )
    width = max(24, *(len(label) + 2 for label in runs))
    for tier in ("realtime", "batch", "offline"):
        click.echo(f"\n{tier:<22}" + "".join(f"{label:>{width}}" for label in runs))
        for title, key, pattern in rows:
            cells = []
            for result in runs.values():
                r = result[tier]
                cells.append(f"{r['completed']}/{r['arrived']}" if key is None else fmt(r[key], pattern))
            click.echo(f"  {title:<20}" + "".join(f"{c:>{width}}" for c in cells))


@prio.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--tier", cls=CeleryOption, default="realtime", help="Lift it into this tier (default realtime).")
@click.pass_context
def boost(ctx, task_id: str, tier: str):
    """Lift a queued task into a higher tier now (priority inheritance by hand): prints what happened."""
    from ..boost import boost as boost_task

    app = ctx.obj.app
    try:
        outcome = boost_task(task_id, tier, app=app)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tier") from None
    where = f" from {outcome.from_tier.label}" if outcome.from_tier is not None else ""
    detail = f" ({outcome.detail})" if outcome.detail else ""
    click.echo(f"{task_id}: {outcome.outcome}{where} -> {outcome.tier.label}{detail}")


@prio.group()
def dead():
    """Messages evicted from a full drop_oldest tier, and messages a worker could not run (with the reason)."""


@dead.command("list", cls=CeleryCommand)
@click.option("--limit", cls=CeleryOption, type=int, default=100, help="Show at most N, oldest first.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def dead_list(ctx, limit: int, as_json: bool):
    """The dead letters, oldest first: id, task, the queue it came from, why, and when."""
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
    """Put dead letters back on the queues they came from, oldest first (after the cause is fixed)."""
    _, settings, adapter = _context(ctx)
    try:
        moved, left, skipped = adapter.dead_requeue(settings, limit)
    finally:
        adapter.close()
    click.echo(f"requeued {moved}; {left} left in {settings.dead_letter_queue}")
    if skipped:
        click.echo(
            f"skipped {skipped}: malformed, or not addressed to a queue of this app "
            f"(left in {settings.dead_letter_queue}; see 'dead list')"
        )


@dead.command("purge", cls=CeleryCommand)
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help="Do not ask.")
@click.pass_context
def dead_purge(ctx, force: bool):
    """Delete every dead letter (asks first, unless --force)."""
    _, settings, adapter = _context(ctx)
    try:
        if not force:
            click.confirm(f"Delete every message in {settings.dead_letter_queue}?", abort=True)
        count = adapter.dead_purge(settings)
    finally:
        adapter.close()
    click.echo(f"purged {count} from {settings.dead_letter_queue}")
