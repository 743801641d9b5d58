"""Reservation verbs (OJS ML §8.3): `reservations`, `reserve FILE`, `release ID`.

Key decision: these are thin wrappers over `OJSML.reserve`/`release`/
`reservations`, so the CLI and the Python API check the same things and print
the same errors (a `SpecError` names the attribute; exit 1).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from celery_ojs_ml.cli.io import EXIT_INVALID, read_document
from celery_ojs_ml.errors import SpecError


def _plugin(ctx: click.Context, app_name: str | None) -> Any:
    from celery_ojs_ml.cli.app import load_plugin

    return load_plugin(ctx, app_name)


@click.command()
@click.option("-A", "--app", "app_name", metavar="MODULE[:ATTR]", help="The Celery app.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
@click.pass_context
def reservations(ctx: click.Context, app_name: str | None, as_json: bool) -> None:
    """List reservations: id, requirements, where placed, what runs inside, expiry."""
    plugin = _plugin(ctx, app_name)
    records = plugin.reservations()
    inside = _inside(plugin)
    for rid, record in records.items():
        record["running"] = sorted(inside.get(rid, ()))
    if as_json:
        click.echo(json.dumps(records, indent=2, sort_keys=True, default=str))
        return
    if not records:
        click.echo("no reservations")
        return
    now = time.time()
    for rid, r in sorted(records.items()):
        click.echo(_line(rid, r, now))


def _line(rid: str, r: dict[str, Any], now: float) -> str:
    wants = ", ".join(
        f"{k.removeprefix('ext_ml_')}={v}" for k, v in sorted(r["requirements"].items())
    )
    state = r.get("state")
    where = f"on {r['worker']}" if state == "placed" else state
    if state == "waiting" and r.get("reason"):
        where = f"waiting: {r['reason']}"
    if state == "ended":
        where = f"ended ({r.get('why') or '?'})"
    expires = r.get("expires_at")
    left = "never" if expires is None else f"in {max(0.0, float(expires) - now):.0f}s"
    running = ", ".join(r["running"]) or "nothing"
    return f"{rid}: {wants}; {where}; runs {running}; expires {left}"


def _inside(plugin: Any) -> dict[str, list[str]]:
    """Task ids running inside each reservation, from the leases."""
    from celery_ojs_ml.store.leases import LeaseBook

    out: dict[str, list[str]] = {}
    for lease in LeaseBook(plugin.store, plugin.settings.lease_ttl_s).all():
        rid = (lease.get("headers") or {}).get("ext_ml_reservation_id")
        if isinstance(rid, str):
            out.setdefault(rid, []).append(str(lease.get("task_id")))
    return out


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--id", "reservation_id", default=None, help="The reservation id (default: fresh).")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Hold it this long, s.")
@click.option("-A", "--app", "app_name", metavar="MODULE[:ATTR]", help="The Celery app.")
@click.pass_context
def reserve(
    ctx: click.Context,
    file: str,
    reservation_id: str | None,
    timeout_s: float | None,
    app_name: str | None,
) -> None:
    """Reserve the resources FILE describes (ext_ml_* attributes); print the id."""
    doc = read_document(file)
    plugin = _plugin(ctx, app_name)
    try:
        rid = plugin.reserve(doc, reservation_id=reservation_id, timeout_s=timeout_s)
    except SpecError as exc:
        click.echo(f"invalid reservation: {exc}", err=True)
        raise SystemExit(EXIT_INVALID) from None
    click.echo(rid)


@click.command()
@click.argument("reservation_id")
@click.option("-A", "--app", "app_name", metavar="MODULE[:ATTR]", help="The Celery app.")
@click.pass_context
def release(ctx: click.Context, reservation_id: str, app_name: str | None) -> None:
    """End a reservation; exit 1 if it was not held."""
    plugin = _plugin(ctx, app_name)
    if not plugin.release(reservation_id):
        click.echo(f"{reservation_id} is not a held reservation", err=True)
        raise SystemExit(EXIT_INVALID)
    click.echo(f"{reservation_id}: released")
