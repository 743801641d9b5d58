"""Live verbs against a running fleet: `status`, `explain TASK_ID|FILE`, `submit FILE`.

Key decision: the Celery app comes from `celery -A proj ojs-ml ...` (Celery's
`CLIContext` in `ctx.obj`) or from the verb's own `-A/--app` option
(`cli.app.load_plugin`). `explain` serves both its offline
form (`--job --workers`, delegated unchanged to the offline verb) and the live
one, so the verb name stays one command with one help page.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from celery_ojs_ml.cli import fleet as fleet_view
from celery_ojs_ml.cli import offline, reserve, sched
from celery_ojs_ml.cli.app import app_option, json_option, load_plugin, timeout_option
from celery_ojs_ml.cli.io import EXIT_INVALID, EXIT_OK, Unreadable, complain, read_document
from celery_ojs_ml.cli.progress import progress_of
from celery_ojs_ml.cli.queued import find_granted, find_queued, live_fleet
from celery_ojs_ml.errors import ConfigError, SpecError, UnsatisfiableError
from celery_ojs_ml.matching import pending_message, rank
from celery_ojs_ml.spec.documents import requirements_doc
from celery_ojs_ml.store.deadletter import dead_job

if TYPE_CHECKING:  # Celery is imported when a live verb runs, so offline verbs start fast
    from celery_ojs_ml.plugin import OJSML

_DOC_SUFFIXES = (".json", ".yaml", ".yml")


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=repr)


def _fail(what: str, exc: Exception) -> click.ClickException:
    return click.ClickException(f"{what}: {exc.__class__.__name__}: {exc}")


# -- status -----------------------------------------------------------------------------------


@click.command()
@app_option
@timeout_option
@json_option
@click.pass_context
def status(ctx: click.Context, app_name: str | None, timeout: float, as_json: bool) -> None:
    """Workers' capabilities, free and used GPUs, held and waiting jobs with reasons."""
    plugin = load_plugin(ctx, app_name)
    try:
        report = fleet_view.gather(plugin, timeout)
    except Exception as exc:  # broker down: say so instead of a traceback
        raise _fail("cannot reach the broker", exc) from None
    click.echo(_dump(report) if as_json else fleet_view.render_status(report))


# -- explain ----------------------------------------------------------------------------------


@click.command()
@click.argument("target", required=False, metavar="[TASK_ID|FILE]")
@click.option("--job", "job_path", type=click.Path(), help="Offline: job file (with --workers).")
@click.option(
    "--workers",
    "workers_path",
    type=click.Path(),
    help="Offline: a directory of worker files, or a file with one worker or a list.",
)
@app_option
@timeout_option
@json_option
@click.pass_context
def explain(
    ctx: click.Context,
    target: str | None,
    job_path: str | None,
    workers_path: str | None,
    app_name: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Why a task waits or where it runs; or rank workers for a job file.

    Live: `explain TASK_ID` or `explain FILE` against the running fleet (needs
    -A). Offline: `explain --job FILE --workers PATH`, no broker needed.
    """
    if job_path or workers_path:
        if not (job_path and workers_path) or target:
            raise click.UsageError(
                "offline explain takes --job FILE --workers PATH and no TASK_ID|FILE; "
                "live explain takes TASK_ID|FILE and -A, e.g. `celery -A proj ojs-ml explain "
                "job.json`",
                ctx,
            )
        ctx.invoke(offline.explain, job_path=job_path, workers_path=workers_path)
        return
    if not target:
        raise click.UsageError("missing TASK_ID|FILE (or --job FILE --workers PATH)", ctx)
    plugin = load_plugin(ctx, app_name)
    if Path(target).is_file():
        _explain_file(plugin, target, as_json)
    elif target.endswith(_DOC_SUFFIXES) or "/" in target:
        raise Unreadable(f"cannot read {target}: no such file")
    else:
        _explain_task(plugin, target, timeout, as_json)


def _dead_letter(plugin: OJSML, task_id: str) -> dict[str, Any] | None:
    """A dead-lettered job as `explain` shows it: state `dead`, with its reason."""
    record = dead_job(plugin.store, task_id)
    if record is None:
        return None
    keep = ("name", "reason", "last_checkpoint", "at", "retries")
    return {"task_id": task_id, "state": "dead", "worker": None, **{k: record.get(k) for k in keep}}


def _explain_task(plugin: OJSML, task_id: str, timeout: float, as_json: bool) -> None:
    try:
        report = fleet_view.gather(plugin, timeout)
    except Exception as exc:
        raise _fail("cannot reach the broker", exc) from None
    found = fleet_view.locate(task_id, report)
    if found["state"] == "running" and "progress" not in found:
        found["progress"] = progress_of(plugin, task_id)
    if found["state"] == "unknown":
        try:
            found = find_granted(plugin, task_id) or find_queued(plugin, task_id) or found
        except LookupError as exc:  # RabbitMQ: queued messages cannot be listed
            found["note"] = f"queued messages were not searched: {exc}"
        except Exception as exc:
            raise _fail("cannot search the class queues", exc) from None
    if found["state"] == "unknown":
        found = _dead_letter(plugin, task_id) or found
    click.echo(_dump(found) if as_json else fleet_view.render_location(found, report["time"]))
    sys.exit(EXIT_INVALID if found["state"] == "unknown" else EXIT_OK)


def _explain_file(plugin: OJSML, path: str, as_json: bool) -> None:
    try:
        req = requirements_doc(read_document(path), plugin.parse_options).requirements
    except SpecError as exc:
        for v in exc.violations:
            complain(f"{path}: {v}")
        sys.exit(EXIT_INVALID)
    try:
        workers, free = live_fleet(plugin)
    except Exception as exc:  # store down: exit 1 with the reason, not a traceback
        raise _fail("cannot read the live workers from the store", exc) from None
    ranked = rank(req, workers, free)
    message = pending_message(r for _, r in ranked)
    if as_json:
        rows = [{"worker": name, **r.as_dict()} for name, r in ranked]
        click.echo(_dump({"workers": rows, "pending_message": message}))
    else:
        for name, r in ranked:
            why = "; ".join(x.message for x in r.reasons)
            row = f"{name:<24} {r.verdict.value:<5} score {r.score:g}"
            click.echo(f"{row}  {why}" if why else row)
        click.echo(message)
    sys.exit(EXIT_OK if any(r.eligible for _, r in ranked) else EXIT_INVALID)


# -- submit -----------------------------------------------------------------------------------


@click.command()
@click.argument("file", type=click.Path())
@click.option("--wait", is_flag=True, help="Wait for the results (needs a result backend).")
@click.option(
    "--wait-timeout", type=float, default=None, help="Seconds to wait with --wait (default: none)."
)
@app_option
@json_option
@click.pass_context
def submit(
    ctx: click.Context,
    file: str,
    wait: bool,
    wait_timeout: float | None,
    app_name: str | None,
    as_json: bool,
) -> None:
    """Validate and publish an OJS job, workflow or Flux jobspec; print the task id(s)."""
    plugin = load_plugin(ctx, app_name)
    doc = read_document(file)
    if wait and not plugin.app.conf.result_backend:
        raise click.UsageError(
            "--wait needs a result backend; set one on the app, e.g. "
            'app.conf.result_backend = "redis://127.0.0.1:6379/1"',
            ctx,
        )
    result = _publish(plugin, doc, file)
    rows = [{"task_id": tid} for tid in task_ids(result)]
    if wait:
        for row in rows:
            row.update(_outcome(plugin, row["task_id"], wait_timeout))
    if as_json:
        click.echo(_dump(rows))
    else:
        for row in rows:
            extra = f" {row['state']} {row['result']!r}" if wait else ""
            click.echo(f"{row['task_id']}{extra}")
    failed = wait and any(row["state"] != "SUCCESS" for row in rows)
    sys.exit(EXIT_INVALID if failed else EXIT_OK)


def _publish(plugin: OJSML, doc: Any, path: str) -> Any:
    try:
        return plugin.submit(doc)
    except SpecError as exc:
        for v in exc.violations:
            complain(f"{path}: {v}")
    except (ConfigError, UnsatisfiableError) as exc:
        complain(f"{path}: {exc}")
    except Exception as exc:  # broker down: exit 1 with the reason, not a traceback
        raise _fail("cannot publish", exc) from None
    sys.exit(EXIT_INVALID)


def task_ids(result: Any) -> list[str]:
    """Every task id of a submission, in order: a task, each chain link, each group member."""
    from celery.result import AsyncResult, GroupResult

    if isinstance(result, GroupResult):
        return [tid for member in result.results for tid in task_ids(member)]
    ids: list[str] = []
    node = result
    while isinstance(node, AsyncResult):
        ids.append(str(node.id))
        node = node.parent
    return ids[::-1]


def _outcome(plugin: OJSML, task_id: str, timeout: float | None) -> dict[str, Any]:
    result = plugin.app.AsyncResult(task_id)
    try:
        value = result.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
    except Exception as exc:  # celery.exceptions.TimeoutError and backend errors
        return {"state": result.state, "result": f"{exc.__class__.__name__}: {exc}"}
    return {"state": result.state, "result": value}


LIVE_COMMANDS = (
    status,
    explain,
    submit,
    sched.scheduler,
    sched.prioritize,
    reserve.reservations,
    reserve.reserve,
    reserve.release,
)
"""Registered on the `ojs-ml` group; this `explain` replaces the offline-only one."""

__all__ = ["LIVE_COMMANDS", "explain", "load_plugin", "status", "submit", "task_ids"]
