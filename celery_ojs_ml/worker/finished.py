"""A job whose final checkpoint is committed is done: a copy of it is settled, never run.

Key decision: `ckpt.save(final=True, result=...)` marks the job done in the same
atomic commit as its last checkpoint (`store.checkpoints.final_of`). A worker that
dies after that commit but before Celery stored the result leaves the job to be
delivered again (its lease is claimed, or a preempted copy is re-published), and the
copy would run the body once more from the final checkpoint. The lease claimer and
the gate read the record first and store the recorded result as the job's `SUCCESS`
instead. So the body runs to its final commit once; what it does after that commit
(outside it) may be skipped, and what it did before may repeat (docs/operations.md).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery import states as celery_states
from celery.worker import state as worker_state

from celery_ojs_ml.store.checkpoints import final_of
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h

log = logging.getLogger("celery_ojs_ml.worker.core")
CHECKPOINTED = "ext_ml_checkpoint_enabled"
"""The canonical header of a job that checkpoints (only such a job has a final record)."""


def final_result(store: OJSStore, task_id: str) -> dict[str, Any] | None:
    """The job's final record, or None (also when the store does not answer: the copy
    then runs, at least once, as without the record)."""
    try:
        return final_of(store, task_id)
    except Exception as exc:
        log.warning("ojs-ml: could not read the final checkpoint of %s: %s", task_id, exc)
        return None


def store_success(app: Celery, task_id: str, result: Any) -> None:
    """Store `result` as the job's `SUCCESS`, unless the backend already holds its end."""
    backend = app.backend
    if type(backend).__name__ == "DisabledBackend":
        return
    try:
        if app.AsyncResult(task_id).state in celery_states.READY_STATES:
            return
        backend.store_result(task_id, result, celery_states.SUCCESS)
    except Exception as exc:
        log.warning("ojs-ml: could not store the recorded result of %s: %s", task_id, exc)


def settle_claimed(app: Celery, store: OJSStore, task_id: str) -> bool:
    """A claimed lease's job: True (and its result stored) when its final checkpoint is
    committed, so the claimer releases the lease instead of re-publishing the job."""
    final = final_result(store, task_id)
    if final is None:
        return False
    store_success(app, task_id, final.get("result"))
    log.warning("ojs-ml: %s committed its final checkpoint before its worker died; done", task_id)
    return True


def settle_copy(app: Celery, store: OJSStore, req: Any) -> bool:
    """A copy about to start: True (result stored, message acked) when its job's final
    checkpoint is committed; the caller frees its allocation and does not run it."""
    if not req.request_dict.get(CHECKPOINTED) or h.RENDEZVOUS in req.request_dict:
        return False  # a gang rank runs with its gang: its peers wait for it
    final = final_result(store, req.id)
    if final is None:
        return False
    result = final.get("result")
    store_success(app, req.id, result)
    log.warning(
        "ojs-ml: %s committed its final checkpoint (%s) in an earlier run; not running it again",
        req.id,
        final.get("sequence"),
    )
    req.send_event("task-succeeded", result=repr(result), runtime=0.0)
    worker_state.task_ready(req)
    req.acknowledge()
    return True
