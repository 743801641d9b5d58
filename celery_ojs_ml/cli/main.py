"""The `celery-ojs-ml` command line, also mounted as `celery ojs-ml`.

Key decision: one click group serves both entry points (the console script
and Celery's `celery.commands` entry point), so every verb exists in both with
the same flags and exit codes.
"""

from __future__ import annotations

import click

from celery_ojs_ml.cli.jobs import checkpoints, dead
from celery_ojs_ml.cli.live import LIVE_COMMANDS
from celery_ojs_ml.cli.metrics import metrics
from celery_ojs_ml.cli.offline import explain, match, probe_cmd, schema, validate
from celery_ojs_ml.cli.tour import tour
from celery_ojs_ml.demo.cli import demo


@click.group(name="ojs-ml")
def cli() -> None:
    """Celery OJS ML: validate, match and explain ML jobs; inspect workers."""


for command in (validate, match, explain, probe_cmd, schema, tour, demo):
    cli.add_command(command)
for command in (checkpoints, dead, metrics):
    cli.add_command(command)
for command in LIVE_COMMANDS:  # status, submit, and an `explain` that also takes the live forms
    cli.add_command(command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="celery-ojs-ml")
