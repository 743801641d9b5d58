"""Offline verbs: validate, match, explain, probe, schema. No broker needed.

Key decision: each command parses its arguments and delegates to the spec,
capabilities and matching layers; output formats are a contract other tools
rely on (`--json` shapes and exit codes 0/1/2), so they are built here in one
place and tested byte for byte.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from celery_ojs_ml.capabilities import capabilities_to_dict, probe
from celery_ojs_ml.cli.io import (
    EXIT_INVALID,
    EXIT_OK,
    complain,
    read_document,
    read_workers,
    worker_from,
)
from celery_ojs_ml.errors import ConfigError, SpecError
from celery_ojs_ml.matching import match as match_one
from celery_ojs_ml.matching import pending_message, rank
from celery_ojs_ml.spec.documents import canonical, parse_document, requirements_doc
from celery_ojs_ml.spec.envelope import DEFAULT_OPTIONS, ParseOptions
from celery_ojs_ml.spec.resources import MLRequirements


def _dump(obj: Any) -> str:
    # str() for the YAML-only types (dates, sets) that pass-through values such as
    # ext_mlx_training_hyperparameters may hold; JSON input never has them.
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print the canonical normalised requirements."
)
@click.option(
    "-A",
    "--app",
    "app_name",
    metavar="MODULE[:ATTR]",
    help="Validate with this app's ojs_ml_* settings (bounds, allow-lists, queue policies).",
)
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.pass_context
def validate(
    ctx: click.Context, as_json: bool, app_name: str | None, files: tuple[str, ...]
) -> None:
    """Validate OJS envelopes, workflows (JSON) and Flux jobspecs (YAML)."""
    options = _parse_options(ctx, app_name)
    failed = False
    for path in files:
        doc = read_document(path)
        try:
            parsed = parse_document(doc, options)
            out = canonical(parsed, options)
        except SpecError as exc:
            failed = True
            for v in exc.violations:
                complain(f"{path}: {v}")
            continue
        for warning in getattr(parsed, "warnings", []):
            complain(f"{path}: warning: {warning}")
        click.echo(_dump(out) if as_json else f"{path}: valid")
    sys.exit(EXIT_INVALID if failed else EXIT_OK)


def _parse_options(ctx: click.Context, app_name: str | None) -> ParseOptions:
    """The app's validator options with `-A` (or under `celery -A`), else the defaults."""
    plugin: Any = getattr(getattr(ctx.obj, "app", None), "ojs_ml", None)
    if app_name:
        from celery_ojs_ml.cli.app import load_plugin  # imports Celery: only when asked

        plugin = load_plugin(ctx, app_name)
    if plugin is None:
        return DEFAULT_OPTIONS
    try:
        options = plugin.parse_options
    except ConfigError as exc:
        raise click.UsageError(f"the app's ojs_ml_* settings are invalid: {exc}", ctx) from None
    return options if isinstance(options, ParseOptions) else DEFAULT_OPTIONS


def _job_requirements(path: str) -> MLRequirements:
    try:
        return requirements_doc(read_document(path)).requirements
    except SpecError as exc:
        for v in exc.violations:
            complain(f"{path}: {v}")
        sys.exit(EXIT_INVALID)


@click.command()
@click.option("--job", "job_path", required=True, type=click.Path(), help="Job file.")
@click.option("--worker", "worker_path", required=True, type=click.Path(), help="Worker file.")
@click.option("--json", "as_json", is_flag=True, help="Print {eligible, reasons, score}.")
def match(job_path: str, worker_path: str, as_json: bool) -> None:
    """Can this worker run this job? Exit 0 eligible, 1 not eligible."""
    req = _job_requirements(job_path)
    worker = worker_from(read_document(worker_path), worker_path)
    result = match_one(req, worker)
    if as_json:
        body = result.as_dict()
        click.echo(_dump({k: body[k] for k in ("eligible", "reasons", "score")}))
    elif result.eligible:
        click.echo(f"eligible (score {result.score:g})")
    else:
        click.echo("not eligible: " + "; ".join(r.message for r in result.reasons))
    sys.exit(EXIT_OK if result.eligible else EXIT_INVALID)


@click.command()
@click.option("--job", "job_path", required=True, type=click.Path(), help="Job file.")
@click.option(
    "--workers",
    "workers_path",
    required=True,
    type=click.Path(),
    help="A directory of worker files, or a file with one worker or a list.",
)
def explain(job_path: str, workers_path: str) -> None:
    """Rank the workers that could run a job, or say why none can."""
    req = _job_requirements(job_path)
    fleet = read_workers(workers_path)
    ranked = rank(req, fleet)
    eligible = [(name, r) for name, r in ranked if r.eligible]
    for name, r in eligible:
        click.echo(f"{name:<24} {r.verdict.value:<5} score {r.score:g}")
    if not eligible:
        click.echo(pending_message(r for _, r in ranked))
    sys.exit(EXIT_OK if eligible else EXIT_INVALID)


@click.command(name="probe")
@click.option("--json", "as_json", is_flag=True, help="Print the §11 capability advertisement.")
def probe_cmd(as_json: bool) -> None:
    """Detect this machine's GPUs (NVML), CPU, memory, disk and /dev/shm."""
    caps = probe()
    if as_json:
        click.echo(_dump(capabilities_to_dict(caps)))
        return
    for key, value in sorted(caps.derived_labels().items()):
        click.echo(f"{key:<20} {value}")


@click.command()
def schema() -> None:
    """Print the JSON Schema of the canonical requirement model."""
    click.echo(_dump(MLRequirements.model_json_schema()))
