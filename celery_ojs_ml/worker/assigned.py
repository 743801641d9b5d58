"""The gate's side of an assignment: start it while its token is current, else hand it back.

Responsibility: what the worker gate does with a message the fleet scheduler
delivered (header `ojs_assign`). The gate is the safety net (DESIGN decision
9): it still checks the fit and pins devices. Here it also makes sure that a
job runs at most once per assignment:
- fits now: the record goes `assigned` -> `started` in one transaction that
  checks the token; a stale copy (the assignment was taken back) is dropped;
- does not fit, but the scheduler planned a preemption (`ojs_victims`): the
  victims are asked to yield and the job is held; its record says until when;
- does not fit otherwise: the assignment is given back with the reason, and
  the scheduler places the job again.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any

from celery.worker import state as worker_state

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.leader.delivery import HEADER_ASSIGN, HEADER_VICTIMS
from celery_ojs_ml.producer.routing import SCHEDULER_HEADERS

if TYPE_CHECKING:
    from celery_ojs_ml.worker.core import MLWorker

log = logging.getLogger(__name__)


def token_of(req: Any) -> str | None:
    """The assignment token of a scheduled message, or None (not from the scheduler)."""
    token = req.request_dict.get(HEADER_ASSIGN)
    return token if isinstance(token, str) and token else None


def victims_of(req: Any) -> tuple[str, ...]:
    """The task ids the scheduler planned to preempt for this job."""
    value = req.request_dict.get(HEADER_VICTIMS)
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def may_start(gate: MLWorker, req: Any, alloc: Allocation) -> bool:
    """Claim the assignment for this run; False (message dropped) when it is stale."""
    token = token_of(req)
    if token is None:
        return True
    outcome = gate.book.start(req.id, token, gate.hostname)
    if outcome == "again" and not _alive(gate, req.id):
        log.warning("ojs-ml: %s is delivered again and holds no lease; running it again", req.id)
        return True
    if outcome in ("stale", "again"):
        log.warning("ojs-ml: %s was assigned elsewhere since; dropping this copy", req.id)
        gate.allocator.free(req)
        drop(req)
        return False
    if outcome == "unknown":
        log.warning("ojs-ml: the store has no record of %s's assignment; running it", req.id)
    return True


def hold_for_victims(gate: MLWorker, req: Any, grace_s: float) -> None:
    """Tell the scheduler this worker holds the job while its victims yield."""
    until = time.time() + grace_s + gate.settings.max_hold_s
    try:
        gate.book.hold(req.id, until)
    except Exception as exc:
        log.warning("ojs-ml: could not record the hold of %s: %s", req.id, exc)


def give_back(gate: MLWorker, req: Any, reason: str) -> None:
    """The assignment cannot run here: back to the scheduler with the reason; drop the copy.

    A copy delivered *again* (its run started here, then died before its lease
    was written, and the broker restored the message) is the job's only copy
    when no lease shows that run alive: it goes back to the pending set with
    this message, never dropped alone.
    """
    token = token_of(req)
    assert token is not None
    why = f"assigned to {gate.hostname}, which gave it back: {reason}"
    try:
        if (
            not gate.book.give_back(req.id, token, why)
            and not _alive(gate, req.id)
            and gate.book.give_back(req.id, token, why, msg=message_of(req))
        ):
            log.warning("ojs-ml: %s was delivered again after its run died unleased", req.id)
    except Exception as exc:  # the scheduler takes it back after the assignment timeout
        log.warning("ojs-ml: could not give %s back: %s", req.id, exc)
    log.info("ojs-ml: gave %s back to the scheduler: %s", req.id, reason)
    drop(req)
    gate.wake_scheduler()


def _alive(gate: MLWorker, task_id: str) -> bool:
    """Whether the first run of a copy delivered again may still be running: it holds a
    lease, or it runs here (its lease write failed, so the broker kept its message unacked
    and restored it after the visibility timeout)."""
    return task_id in gate._requests or gate.leases.get(task_id) is not None


_GATE_HEADERS = ("ojs_devices", "ojs_node", "ojs_pin", "ojs_lease", "ojs_gpu_share")
"""What the gate adds to a request's headers when it dispatches it (`Gate._dispatch`)."""


def message_of(req: Any) -> dict[str, Any]:
    """A delivered request as the pending set stores a message (`Intake._on_message`)."""
    body = req.body if isinstance(req.body, bytes) else str(req.body).encode()
    skip = (*SCHEDULER_HEADERS, *_GATE_HEADERS)
    headers = {k: v for k, v in req.request_dict.items() if k not in skip}
    properties = {
        "correlation_id": req.correlation_id,
        "reply_to": req.reply_to,
        "priority": (req.delivery_info or {}).get("priority"),
    }
    return {
        "body": base64.b64encode(body).decode(),
        "content_type": req.content_type,
        "content_encoding": req.content_encoding,
        "headers": headers,
        "properties": {k: v for k, v in properties.items() if v is not None},
    }


def drop(req: Any) -> None:
    """Remove this copy of the message (the store holds the job)."""
    worker_state.task_ready(req)
    req.reject(requeue=False)


def band_of_request(req: Any) -> str:
    """The band the router put on the message (`ojs_band`)."""
    value = req.request_dict.get("ojs_band")
    return value if isinstance(value, str) else "on-demand"


def preempt_planned(gate: MLWorker, req: Any, victims: tuple[str, ...]) -> float | None:
    """Ask the victims the scheduler chose to yield; the longest grace, or None (none here)."""
    from celery_ojs_ml.allocator.policy import is_victim
    from celery_ojs_ml.worker.preemption import grace_of

    band = band_of_request(req)
    allow = gate.settings.allow_on_demand_preemption
    planned = [
        a
        for a in gate.allocator.allocations()
        if getattr(a.key, "id", None) in victims and is_victim(a, band, allow_on_demand=allow)
    ]
    if not planned:
        return None
    longest = 0.0
    for alloc in planned:
        grace = grace_of(alloc.key)
        longest = max(longest, grace)
        if alloc.key not in gate.preemptions:
            gate.preemptions.preempt(alloc.key, grace)
    return longest
