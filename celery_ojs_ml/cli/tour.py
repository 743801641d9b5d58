"""`celery-ojs-ml tour`: an offline tour of who can run what, and why not.

Key decision: the tour uses the real spec, capability and matching layers on
the spec's own example jobs and a few simulated workers, so what it prints is
exactly what the plugin decides; it needs no broker and ends in a second.
"""

from __future__ import annotations

from pathlib import Path

import click

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.cli.io import read_document, read_workers
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.matching import Verdict, match, pending_message
from celery_ojs_ml.spec.documents import parse_document
from celery_ojs_ml.spec.envelope import Job
from celery_ojs_ml.spec.flux import FluxJob
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.workflow import Workflow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _fleet(examples: Path) -> dict[str, Capabilities]:
    return read_workers(str(examples / "workers"))


def _jobs(path: Path) -> list[tuple[str, Job]]:
    parsed = parse_document(read_document(str(path)))
    if isinstance(parsed, Workflow):
        return [(f"{path.stem}[{i}] {s.type}", s) for i, s in enumerate(parsed.steps)]
    if isinstance(parsed, FluxJob):
        req = normalize(parsed.slot_requirements()).requirements
        return [(f"{path.stem} (x{parsed.task_count} slots)", Job(type="flux", requirements=req))]
    return [(f"{path.stem} {parsed.type}", parsed)]


def _row(name: str, job: Job, fleet: dict[str, Capabilities]) -> str:
    results = {w: match(job.requirements, caps) for w, caps in fleet.items()}
    marks = "".join(f"{'yes' if r.verdict is Verdict.FITS else '-':^15}" for r in results.values())
    line = f"{name[:46]:<46} {marks}"
    if not any(r.eligible for r in results.values()):
        line += "\n" + " " * 4 + "why not: " + pending_message(results.values())
    return line


@click.command()
@click.option(
    "--examples",
    "examples_dir",
    type=click.Path(exists=True, file_okay=False),
    default=str(EXAMPLES),
    show_default=True,
    help="Directory with jobs/ inside.",
)
def tour(examples_dir: str) -> None:
    """Validate every example job and show which sample worker can run it (offline)."""
    fleet = _fleet(Path(examples_dir))
    click.echo(f"{'job':<46} " + "".join(f"{w:^15}" for w in fleet))
    invalid = 0
    for path in sorted((Path(examples_dir) / "jobs").glob("*.[jy]*")):
        try:
            jobs = _jobs(path)
        except SpecError as exc:
            invalid += 1
            click.echo(f"{path.stem}: INVALID: {exc}")
            continue
        for name, job in jobs:
            click.echo(_row(name, job, fleet))
    click.echo(f"\n{invalid} invalid example(s); workers: {', '.join(fleet)}")
