"""The worker's dispatch gate: allocate, pin, dispatch, release, hold (RFC 27 per worker).

Key decisions:
* The gate wraps `consumer.on_task_request` in the step's `__init__`, before
  strategies capture it; it allocates devices in the main process and hands them
  to the child in `request_dict`.
* A job that does not fit now is held (or given back to the scheduler with a
  reason); one that can never run here is refused with the reason (`refusal`).
* Devices are freed from instance-level `on_success`/`on_failure`/`on_timeout`
  wrappers keyed by the Request object, then held jobs are pumped (`gate_release`).
* Per job, nothing is looked up through another layer: what the gate calls on
  its collaborators is bound once, when the gate is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.allocator import Allocation, Allocator, Denied, Pending
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.headers import DEVICES, NODE, PENDING, PIN, PREFETCH, RENDEZVOUS, SHARE
from celery_ojs_ml.wire.inbound import BadMessage, InboundCheck
from celery_ojs_ml.wire.labels import job_labels
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.assigned import Assignments, token_of, victims_of
from celery_ojs_ml.worker.cpu_cores import assign_host
from celery_ojs_ml.worker.gate_release import GateRelease
from celery_ojs_ml.worker.granted import Grants, epoch_of
from celery_ojs_ml.worker.lease_keeping import LeaseKeeper
from celery_ojs_ml.worker.pipelining import Pipeline
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.refusal import refuse
from celery_ojs_ml.worker.running import Running
from celery_ojs_ml.worker.sharing import share_info
from celery_ojs_ml.worker.telemetry import started as started_event

log = logging.getLogger("celery_ojs_ml.worker.core")


class Gate(GateRelease):
    """The gate of one consumer (see module doc)."""

    def __init__(
        self,
        consumer: Any,
        settings: OJSMLSettings,
        caps: Capabilities,
        admission: InboundCheck,
        allocator: Allocator,
        running: Running,
        *,
        hostname: str,
        prefork: bool,
        preemptions: Preemptions,
        grants: Grants,
        assignments: Assignments,
        leases: LeaseKeeper,
        resubscribe: Callable[[], None],
        hold_reservations: Callable[[], None],
        wake_scheduler: Callable[[], None],
        holds_model: Callable[[MLRequirements], Any],
    ) -> None:
        self.c, self.settings, self.caps, self.admission = consumer, settings, caps, admission
        self.allocator, self.lock, self.hold_until = allocator, running.lock, running.hold_until
        self.requests, self.devices_by_id = running.requests, running.devices_by_id
        self.running = running
        self.hostname, self.prefork = hostname, prefork
        self.preemptions, self.grants, self.assignments = preemptions, grants, assignments
        self._take_lease, self._failing = leases.take_lease, leases.failing
        self._ack, self._release_lease = leases.ack, leases.release_lease
        self._forget_granted = leases.forget_granted
        self.resubscribe, self.hold_reservations = resubscribe, hold_reservations
        self.wake_scheduler, self.holds_model = wake_scheduler, holds_model
        self.store: OJSStore = None  # type: ignore[assignment]
        self.router: Any = None
        """The warm-children router (`warm_pool.Router`); None where it does not run."""
        self.batching: Any = None  # dynamic batching (`batching.Batcher`), set by `core`
        self.pipeline: Pipeline | None = None  # jobs written behind a running one, or None
        self._pump_due = False
        self._pumping = False
        self._orig_handler: Callable[[Any], Any] = consumer.on_task_request
        consumer.on_task_request = self.on_task_request

    def refuse(self, req: Any, reason: str) -> None:
        """Dead-letter, fail and drop a message the gate cannot run (`refusal`)."""
        refuse(self.store, self.hostname, self.settings.max_header_bytes, req, reason)

    def on_task_request(self, req: Any) -> Any:
        headers = req.request_dict
        try:
            ml = self.admission.requirements(headers)
        except BadMessage as exc:
            return self.refuse(req, str(exc))
        if ml is None:
            return self._orig_handler(req)
        try:
            found = self._gate(req, ml)
        except Exception as exc:  # never out of on_task_received: it would stop the consumer
            log.exception("ojs-ml: the gate failed on %s", req.id)
            with self.lock:
                self.allocator.free(req)
            return self.refuse(req, f"the worker's gate failed: {exc!r}")
        if self.router is not None:
            self.router.write_now()  # a job dispatched here reaches its child at once
        return found

    def _gate(self, req: Any, ml: MLRequirements) -> Any:
        headers = req.request_dict
        epoch = epoch_of(req)
        if epoch is not None:
            return self._gate_granted(req, ml, epoch)
        token = token_of(req)
        if self.grants.mine and token is not None:
            self.grants.recheck_grants()  # assignments flow again: were the grants revoked?
        rid = ml.ext_ml_reservation_id
        if rid is not None and rid not in self.allocator.pools:
            self.hold_reservations()  # placed since the last refresh?
        with self.lock:
            ml = self.preemptions.cap(ml, headers)
            outcome = self._try_alloc(req, ml)
            if token is not None and not isinstance(outcome, Allocation):
                return self._not_fitting(req, ml, outcome)
            if isinstance(outcome, Pending) and self.follow(req, ml):
                return None
            if isinstance(outcome, Pending) and outcome.band != BANDS[-1]:
                grace = self.preemptions.make_room(ml, outcome.band)
                if grace is not None:  # hold it until the victims have yielded or been killed
                    self.hold_until[req] = time.monotonic() + grace + self.settings.max_hold_s
            return self._handle(req, outcome)

    def _gate_granted(self, req: Any, ml: MLRequirements, epoch: str) -> Any:
        """A job published under a grant (`worker.granted`): run it while the grant
        is this worker's, else give it back to the intake."""
        self._forget_granted(req.id)
        if not self.grants.grant_current(epoch):
            self.grants.give_back_granted(req, "its class's grant ended")
            return None
        with self.lock:
            outcome = self._try_alloc(req, ml)
            if isinstance(outcome, Allocation):
                self.grants.granted_started = time.monotonic()
                return self._dispatch(req, outcome)
            if isinstance(outcome, Pending) and self.follow(
                req, self.preemptions.cap(ml, req.request_dict)
            ):
                self.grants.granted_started = time.monotonic()
                return None
            first = isinstance(outcome, Pending) and self.grants.hold_granted(req, outcome)
        if isinstance(outcome, Denied):
            self.grants.give_back_granted(req, f"it cannot run here: {outcome.reason}")
        elif first:  # the leader sees the backlog (room elsewhere ends the grant)
            self.wake_scheduler()
        return None

    def _try_alloc(self, req: Any, ml: MLRequirements) -> Allocation | Pending | Denied:
        """The allocator's answer for a request (under `self.lock`)."""
        headers = req.request_dict
        return self.allocator.try_alloc(
            req,
            req.id,
            ml,
            priority=band_priority(headers),
            labels=job_labels(req.name, headers),
            prefer=self._warm_sets(ml),
        )

    def _warm_sets(self, ml: MLRequirements) -> list[tuple[int, ...]]:
        """Device sets idle warm children are bound to (`warm_pool`), model holders first."""
        return self.router.idle_bound(self.holds_model(ml)) if self.router else []

    def move(
        self, task_id: str, devices: tuple[int, ...], written: Callable[[str], bool]
    ) -> dict[str, tuple[int, ...]]:
        """The router moves a dispatched job onto an idle warm child's devices: free ones,
        or those of a job no child has taken yet (`written` says which), which gets the
        first job's devices in exchange. The jobs whose devices changed; {} if none."""
        with self.lock:
            req = self.requests.get(task_id)
            if req is None:
                return {}
            if self.allocator.move(req, devices) is not None:
                moved = {task_id: devices}
            else:
                other = next(
                    (t for t, d in self.devices_by_id.items()
                     if d == devices and t != task_id and not written(t)),
                    None,
                )  # fmt: skip
                peer = None if other is None else self.requests.get(other)
                if other is None or peer is None or self.allocator.swap(req, peer) is None:
                    return {}
                moved = {task_id: devices, other: self.devices_by_id[task_id]}
            for moved_id, moved_to in moved.items():
                self.devices_by_id[moved_id] = moved_to
                self.requests[moved_id].request_dict[DEVICES] = list(moved_to)
        return moved

    def _not_fitting(self, req: Any, ml: MLRequirements, outcome: Pending | Denied) -> Any:
        """A scheduled job that does not fit: preempt the planned victims, else give it back."""
        if isinstance(outcome, Pending) and req.request_dict.get(PREFETCH):
            if self.follow(req, ml):
                return None
            # delivered ahead of capacity: wait here, start as soon as a job ends
            self.hold_until[req] = time.monotonic() + self.settings.assignment_timeout_s - 1
            return self._handle(req, outcome)
        victims = victims_of(req)
        grace = self.assignments.preempt_planned(req, victims) if victims else None
        if isinstance(outcome, Pending) and grace is not None:
            self.hold_until[req] = time.monotonic() + grace + self.settings.max_hold_s
            self.assignments.hold_for_victims(req, grace)
            return self._handle(req, outcome)
        self.assignments.give_back(req, outcome.reason)
        return None

    def _handle(self, req: Any, outcome: Allocation | Pending | Denied) -> Any:
        if isinstance(outcome, Allocation):
            return self._dispatch(req, outcome)
        if isinstance(outcome, Pending):
            log.info("ojs-ml: holding %s: %s", req.id, outcome.reason)
            self.allocator.hold(outcome)
            self.c.qos.increment_eventually()
            self.resubscribe()
            return None
        log.warning(
            "ojs-ml: %s cannot run %s here (%s); requeueing", self.hostname, req.id, outcome.reason
        )
        self._requeue(req)
        return None

    def _dispatch(self, req: Any, alloc: Allocation) -> Any:
        if self.batching is not None and self.batching.takes(req, alloc):
            return None  # it joins or heads a batch (`batching`), which dispatches it
        if not self.assignments.may_start(req, alloc):
            # A stale copy was dropped and its allocation freed: the jobs held behind it
            # may fit now, and no release will pump them (none may be running here).
            self._pump_soon()
            return None
        log.debug("ojs-ml: dispatch %s on %s", req.id, alloc.devices)
        self._prepare(req, alloc)
        self._account(req, alloc)
        if self.batching is not None:
            self.batching.runs.hand_over(req, alloc)  # the batch it heads, if any
        return self._orig_handler(req)

    def follow(self, req: Any, ml: MLRequirements, *, held: bool = False) -> bool:
        """Write a job that would wait here behind a running job with the same needs, in
        that job's warm child (`pipelining`); False where none may lead it. `held`: it is
        the first held job (else nothing may be held)."""
        if self.pipeline is None or (not held and self.allocator.held_keys()):
            return False
        ahead = self.pipeline.ahead_for(req, ml)
        if ahead is None:
            return False
        if held:
            self.allocator.cancel(req)
            self.hold_until.pop(req, None)
            self.leave_hold(req)
        if not self.assignments.may_start(req, ahead):
            return True  # a stale copy, dropped
        log.debug("ojs-ml: %s follows %s on %s", req.id, ahead.task_id, ahead.devices)
        self._prepare(req, ahead)
        if internals.to_pool_now(self.c, req):  # not revoked meanwhile
            self.pipeline.follow(req, ml, ahead)
        return True

    def _account(self, req: Any, alloc: Allocation) -> None:
        """Record a job that starts on `alloc`: its devices, lease and start (at dispatch, or
        at the hand-over of a job written behind another)."""
        headers = req.request_dict
        if headers.get(PREFETCH) and not self.ahead_enough():
            self.wake_scheduler()  # a job held ahead started: the leader may send the next one
        self.devices_by_id[req.id] = tuple(alloc.devices)
        self.requests[req.id] = req
        if headers.get(PENDING):
            self._clear_pending(req.id)
        self._take_lease(req, alloc)
        self.resubscribe()
        started_event(self.c, req.id, headers)

    def _prepare(self, req: Any, alloc: Allocation) -> None:
        """Put the devices and the pinning into the message, and wrap its callbacks."""
        headers = req.request_dict
        headers[DEVICES] = list(alloc.devices)
        assign_host(req, alloc, self.caps, self.requests, self.settings)  # TPU chips, CPUs
        if alloc.gpu_milli:  # a GPU share: the task reads it in self.request.ojs_gpu_share
            headers[SHARE] = share_info(alloc, self.admission.parse(headers), self.caps)
        headers[NODE] = self.hostname
        headers[PIN] = self.prefork
        if RENDEZVOUS in headers:  # a gang rank's failure re-places its gang:
            headers["ignore_result"] = True  # no FAILURE stored (see worker.gangs)
        req.on_failure = self._failing(req, req.on_failure)
        for name in ("on_success", "on_failure"):
            setattr(req, name, self._releasing(req, getattr(req, name)))
        req.on_timeout = self._timeout_releasing(req, req.on_timeout)

    def _clear_pending(self, task_id: str) -> None:
        try:
            self.store.clear_pending(task_id)
        except Exception as exc:
            log.warning("ojs-ml: could not clear the pending record of %s: %s", task_id, exc)


def band_priority(headers: dict[str, Any]) -> int:
    """The message priority inside its band (higher first): a `priority` header, else the
    Celery priority, which a request keeps in `delivery_info` (celery.worker.request)."""
    value = headers.get("priority")
    if not isinstance(value, int):
        value = (headers.get("delivery_info") or {}).get("priority")
    return int(value) if isinstance(value, int) else 0
