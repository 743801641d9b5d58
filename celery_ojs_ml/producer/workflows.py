"""A batch with callbacks (OJS Workflow Primitives §6) as a Celery chord.

The batch's jobs are the chord's header. The body is the relay task
`ojs_ml.batch_done`, which Celery calls once with every job's result when all
succeeded; it publishes `on_success` and `on_complete`. When any job failed,
Celery calls the body's error callback (`link_error`) instead, the relay
`ojs_ml.batch_failed`; it publishes `on_failure` and `on_complete` (§6.5).
Each callback runs as `callback(results, *its_args)`, `results` holding every
job's result by index (§7.4); a failed job's entry is `{"error": "<type>: <message>"}`.

Key decisions:
- The relays are plain tasks; the callbacks they publish are jobs like any other,
  routed and scheduled by their own `ext_ml_*` attributes. A callback never runs
  inside the process that saw the failure, as Celery runs an error callback that
  takes (request, exc, traceback); the relays are bound tasks, which Celery
  always publishes (checked against Celery 5.7, `Backend._call_task_errbacks`).
- Every callback's task id is fixed when the batch is built, so the body's
  result (name -> task id) says where each one's result will be.
- Celery fires a chord's body or its error callback once (the result backend
  counts the header's results atomically); a relay redelivered after its
  worker died publishes its callbacks again under the same ids.
- A chord needs a result backend: without one, `submit` refuses the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.canvas import Signature, chord, group
from celery.result import AsyncResult

from celery_ojs_ml.errors import ConfigError

DONE = "ojs_ml.batch_done"
FAILED = "ojs_ml.batch_failed"
ON_SUCCESS_PATH = ("on_success", "on_complete")
ON_FAILURE_PATH = ("on_failure", "on_complete")


def install(app: Celery) -> None:
    """Register the two relay tasks on `app` (idempotent)."""

    @app.task(bind=True, name=DONE, shared=False)  # type: ignore[untyped-decorator]
    def batch_done(self: Any, results: list[Any], callbacks: dict[str, Any]) -> dict[str, str]:
        """Every job succeeded: publish `on_success` and `on_complete` with the results."""
        return publish_callbacks(self.app, results, callbacks)

    @app.task(bind=True, name=FAILED, shared=False)  # type: ignore[untyped-decorator]
    def batch_failed(
        self: Any, _failed: str, job_ids: list[str], callbacks: dict[str, Any]
    ) -> dict[str, str]:
        """A job failed: publish `on_failure` and `on_complete` with every job's result."""
        return publish_callbacks(self.app, results_of(self.app, job_ids), callbacks)


def batch_chord(app: Celery, jobs: list[Signature], callbacks: Mapping[str, Signature]) -> Any:
    """The chord of a batch: `jobs` as the header, the relays around `callbacks`."""
    if _no_backend(app):
        raise ConfigError(
            "a batch with callbacks runs as a Celery chord, which needs a result backend "
            "(OJS Workflow Primitives §6.4); set one, e.g. "
            'app.conf.result_backend = "redis://localhost:6379/1"'
        )
    header = group(jobs)
    job_ids = [str(sig.freeze().id) for sig in header.tasks]
    for sig in callbacks.values():
        sig.freeze()  # fixed task ids: the body's result names them
    success = {n: dict(callbacks[n]) for n in ON_SUCCESS_PATH if n in callbacks}
    failure = {n: dict(callbacks[n]) for n in ON_FAILURE_PATH if n in callbacks}
    body = app.signature(DONE, kwargs={"callbacks": success})
    body.link_error(app.signature(FAILED, args=(job_ids, failure)))
    return chord(header, body)


def _no_backend(app: Celery) -> bool:
    from celery.backends.base import DisabledBackend

    return isinstance(app.backend, DisabledBackend)


def publish_callbacks(app: Celery, results: list[Any], callbacks: dict[str, Any]) -> dict[str, str]:
    """Publish each callback as `callback(results, *args)`; returns name -> task id."""
    sent: dict[str, str] = {}
    for name, raw in callbacks.items():
        sig = app.signature(raw)
        sent[name] = str(sig.apply_async(args=(results,)).id)
    return sent


def results_of(app: Celery, job_ids: list[str]) -> list[Any]:
    """Each job's result, a failed one's as `{"error": "<type>: <message>"}`."""
    out: list[Any] = []
    for job_id in job_ids:
        found = AsyncResult(job_id, app=app)
        value = found.result
        if isinstance(value, BaseException):
            out.append({"error": f"{type(value).__name__}: {value}"})
        else:
            out.append(value)
    return out
