"""`celery-ojs-ml demo`: run the specs' example jobs on a simulated three-node fleet.

Key decision: the command parses options and delegates; it exits 0 only when
the demo's own judgement passes (every runnable job done on an eligible node,
every other job waiting with a reason), 1 when it does not, and 2 when the
demo cannot run at all (no fakeredis, Redis unreachable, workers missing).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from celery_ojs_ml.demo.jobs import EXAMPLES
from celery_ojs_ml.demo.session import Outcome, summary
from celery_ojs_ml.demo.table import LivePrinter
from celery_ojs_ml.errors import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


@click.command()
@click.option(
    "--broker",
    default="memory://",
    show_default=True,
    help="memory:// runs three workers in this process; redis://HOST:PORT/DB starts three "
    "real `celery worker` processes on that Redis (also the result backend and the store).",
)
@click.option(
    "--external-workers",
    is_flag=True,
    help="With a Redis broker: do not start workers; wait for a100@demo, l4@demo and "
    "cpu@demo to come up (docker-compose starts them).",
)
@click.option(
    "--timeout", "timeout_s", default=40.0, show_default=True, help="Seconds to wait for the jobs."
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the outcome as JSON to this file.",
)
@click.option(
    "--examples",
    "examples_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=EXAMPLES,
    show_default=True,
    help="Directory with jobs/ inside.",
)
@click.option(
    "--live/--no-live", default=None, help="Redraw the table in place (default: on a TTY)."
)
@click.option("-v", "--verbose", is_flag=True, help="Show worker and plugin logs.")
def demo(
    broker: str,
    external_workers: bool,
    timeout_s: float,
    report: Path | None,
    examples_dir: Path,
    live: bool | None,
    verbose: bool,
) -> None:
    """Submit the specs' example jobs to three simulated workers and show where each ran."""
    logging.basicConfig(level=logging.INFO if verbose else logging.CRITICAL, stream=sys.stderr)
    printer = LivePrinter(live=live)
    try:
        outcome = _run(broker, external_workers, timeout_s, examples_dir, printer, verbose)
    except ConfigError as exc:
        click.echo(f"demo: {exc}", err=True)
        sys.exit(EXIT_UNUSABLE)
    for line in summary(outcome):
        click.echo(line)
    if report is not None:
        outcome.write(report)
    sys.exit(EXIT_OK if outcome.ok else EXIT_FAILED)


def _run(
    broker: str,
    external: bool,
    timeout_s: float,
    examples: Path,
    printer: LivePrinter,
    verbose: bool,
) -> Outcome:
    if broker.startswith("memory://"):
        if external:
            raise ConfigError("--external-workers needs a Redis broker, e.g. --broker redis://...")
        from celery_ojs_ml.demo.embedded import run_embedded

        return run_embedded(printer, timeout_s=timeout_s, examples=examples, verbose=verbose)
    if not broker.startswith(("redis://", "rediss://")):
        raise ConfigError(f"--broker must be memory:// or redis://HOST:PORT/DB, not {broker!r}")
    from celery_ojs_ml.demo.fleet import run_on_redis

    return run_on_redis(
        broker,
        printer,
        timeout_s=timeout_s,
        examples=examples,
        start_workers=not external,
        verbose=verbose,
    )
