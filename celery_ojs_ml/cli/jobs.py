"""Job-state verbs: `checkpoints TASK_ID` and `dead [--retry TASK_ID]`.

Key decision: both read the plugin's Redis store directly (no worker needs to
answer), so they work while the fleet is down, which is when dead-lettered
jobs and their checkpoints matter most.
"""

from __future__ import annotations

import json

import click

from celery_ojs_ml.cli.app import app_option, json_option, load_plugin


@click.command()
@click.argument("task_id")
@app_option
@json_option
@click.pass_context
def checkpoints(ctx: click.Context, task_id: str, app_name: str | None, as_json: bool) -> None:
    """List a job's committed checkpoints, oldest first (OJS ML §9.2)."""
    from celery_ojs_ml.checkpoint import list_checkpoints

    plugin = load_plugin(ctx, app_name)
    found = [m.to_dict() for m in list_checkpoints(plugin.store, task_id)]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo(f"{task_id}: no committed checkpoints")
        return
    header = ("seq", "epoch", "step", "loss", "created_at", "storage_key")
    click.echo("  ".join(header))
    for m in found:
        cells = [m.get("sequence"), m.get("epoch"), m.get("step"), m.get("loss")]
        cells += [m.get("created_at"), m["storage_key"]]
        click.echo("  ".join("-" if c is None else str(c) for c in cells))


@click.command()
@click.option("--retry", "retry_id", metavar="TASK_ID", help="Re-publish this dead job.")
@app_option
@json_option
@click.pass_context
def dead(ctx: click.Context, retry_id: str | None, app_name: str | None, as_json: bool) -> None:
    """List dead-lettered ML jobs with their reason and last checkpoint; `--retry` resumes one."""
    from celery_ojs_ml.store.deadletter import dead_jobs, retry_dead

    plugin = load_plugin(ctx, app_name)
    if retry_id:
        if not retry_dead(plugin.app, plugin.store, retry_id):
            raise click.ClickException(f"{retry_id} is not a dead-lettered job (see `dead`)")
        click.echo(f"{retry_id}: re-published; it resumes from its last checkpoint")
        return
    jobs = dead_jobs(plugin.store)
    if as_json:
        click.echo(json.dumps(jobs, indent=2))
        return
    if not jobs:
        click.echo("no dead-lettered jobs")
    for job in jobs:
        last = job.get("last_checkpoint") or {}
        where = f"epoch {last.get('epoch')} ({last.get('storage_key')})" if last else "none"
        click.echo(f"{job['task_id']}  {job['name']}  {job['reason']}  last checkpoint: {where}")
