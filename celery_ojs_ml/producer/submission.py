"""Submission of OJS documents: an envelope, a workflow or a Flux jobspec becomes Celery work.

An OJS envelope becomes one Celery signature, a workflow a chain or a group of
them (a batch with callbacks a chord: `producer.workflows`), and a Flux jobspec
a group of its tasks (a gang when it spreads one task per node over several
nodes). Key decision: the signatures go out through the
app's ordinary publish path, so the router validates and routes them exactly
as it does a task called from code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.canvas import Signature, chain, group

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.producer.workflows import batch_chord
from celery_ojs_ml.producer.workflows import install as install_relays
from celery_ojs_ml.spec.documents import parse_document
from celery_ojs_ml.spec.envelope import Job, ParseOptions
from celery_ojs_ml.spec.flux import FluxJob
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.spec.workflow import Workflow
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.gangs import gang_headers
from celery_ojs_ml.wire.headers import plugin_publish


class Submission:
    """`signature_for`, `submit` and `gang` of one app (see module doc).

    `parse_options` gives the validator options of the moment (the settings are
    read lazily); `check_reservation` is the publish-time §8.3 check.
    """

    def __init__(
        self,
        app: Celery,
        parse_options: Callable[[], ParseOptions],
        check_reservation: Callable[[MLRequirements], None],
    ) -> None:
        self.app = app
        self._parse_options = parse_options
        self._check_reservation = check_reservation
        install_relays(app)  # a batch's callback relays, on producers and workers alike

    def signature_for(self, doc: Any) -> Signature:
        """A Celery signature for an OJS envelope, a workflow or a Flux jobspec."""
        parsed = parse_document(doc, self._parse_options())
        if isinstance(parsed, Workflow):
            for step in [*parsed.steps, *parsed.callbacks.values()]:  # all before any goes out
                if step.requirements.ext_ml_reservation_id is not None:
                    self._check_reservation(step.requirements)
            sigs = [self._job_signature(step) for step in parsed.steps]
            if parsed.callbacks:  # a batch: its callbacks around a chord (`producer.workflows`)
                calls = {n: self._job_signature(j) for n, j in parsed.callbacks.items()}
                return batch_chord(self.app, sigs, calls)
            return chain(*sigs) if parsed.workflow_type == "chain" else group(*sigs)
        if isinstance(parsed, FluxJob):
            return self._flux_group(parsed)
        return self._job_signature(parsed)

    def submit(self, doc: Any) -> Any:
        """Validate and publish an OJS envelope (either form), a workflow or a Flux jobspec."""
        with plugin_publish():  # a gang's rank headers are the plugin's own
            return self.signature_for(doc).apply_async()

    def _job_signature(self, job: Job) -> Signature:
        if not job.type:
            raise ConfigError('an OJS job needs a type naming the task, e.g. "type": "ml.train"')
        headers: dict[str, Any] = {**job.canonical()}
        if job.queue:
            headers[h.LOGICAL] = job.queue
        if job.last_checkpoint:
            headers[h.LAST_CHECKPOINT] = job.last_checkpoint
        opts: dict[str, Any] = {"headers": headers}
        if job.id:
            opts["task_id"] = job.id
        return self.app.signature(job.type, args=job.args, kwargs=job.kwargs, options=opts)

    def _flux_group(self, flux: FluxJob) -> Signature:
        name = str(flux.command[0]) if flux.command else "flux.task"
        headers: dict[str, Any] = dict(flux.slot_requirements())
        if flux.queue:
            headers[h.LOGICAL] = flux.queue
        if flux.cwd is not None:  # applied around the run by the pool child (`child.run_env`)
            headers[h.CWD] = flux.cwd
        if flux.environment:
            headers[h.ENVIRONMENT] = dict(flux.environment)
        args = list(flux.command[1:])
        if flux.spread and (flux.nodes or 0) > 1 and flux.task_count == flux.nodes:
            # node>slot over N nodes, one task per node: a gang (all ranks or none)
            return gang_group(self.app.signature(name, args=args), flux.nodes or 0, headers)
        return group(
            self.app.signature(name, args=args, options={"headers": dict(headers)})
            for _ in range(flux.task_count)
        )

    def gang(self, sig: Signature, size: int) -> Any:
        """Run `sig` as a gang of `size` ranks: all placed at once on distinct workers, or none.

        Each rank is its own Celery task (one result each) and runs with
        `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK` and `LOCAL_RANK` set
        (torch.distributed `env://`). Returns the group's `GroupResult`.
        """
        with plugin_publish():  # a gang's rank headers are the plugin's own
            return gang_group(sig, size, {}).apply_async()


def gang_group(sig: Signature, size: int, extra: dict[str, Any]) -> Signature:
    """A group of `size` clones of `sig`, each with its rank's gang headers and `extra`."""
    ranks = []
    for headers in gang_headers(size):
        rank = sig.clone()
        merged = {**(rank.options.get("headers") or {}), **extra, **headers}
        rank.set(headers=merged)
        ranks.append(rank)
    return group(ranks)
