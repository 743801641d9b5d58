"""Grants: a class of jobs sent straight to one worker while the fleet is quiet (pure).

Ray's lease reuse, for the fleet scheduler (DESIGN decision 9, "grants"): when a pass
leaves nothing waiting, the next jobs of a class it placed on a worker would go there
again, so the leader grants the class to that worker and publishers send them to the
worker's own queue directly: no admission, pass or assignment per job. The worker's
gate still checks the fit and pins devices.

Key decision: a grant never keeps a job waiting; it ends as soon as one waits
(`to_revoke`). Only "simple" jobs are granted (`grantable`); `grants_after` says which
grants a pass makes, `grant_key` the key a publisher looks a grant up by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery_ojs_ml.matching import match
from celery_ojs_ml.scheduler.model import Decision, PendingJob, WorkerState
from celery_ojs_ml.spec.resources import MLRequirements

AUTO_LABELS = frozenset({"job_type", "queue"})
"""The labels every job shows (`wire.labels.job_labels`); only declared ones count."""


def grant_key(queue: str, band: str, class_id: str) -> str:
    """The field a grant is stored under: the logical queue, the band and the class."""
    return f"{queue}|{band}|{class_id}"


def grantable(
    req: MLRequirements, *, gang: bool, labels: bool, gpu_affinity: str, hints: bool = False
) -> bool:
    """Whether a job of these requirements is placed by its class and free capacity alone.

    No gang, reservation, affinity or anti-affinity rules, declared labels,
    escalation or placement hints (spot preference, data locality), and `pack`
    GPU affinity.
    """
    return not (
        gang
        or labels
        or hints
        or gpu_affinity != "pack"
        or req.ext_ml_reservation_id is not None
        or req.ext_ml_affinity is not None
        or req.ext_ml_anti_affinity is not None
        or req.ext_ml_priority_escalation
    )


def job_grantable(job: PendingJob) -> bool:
    """`grantable` for a waiting job."""
    return grantable(
        job.req,
        gang=job.gang is not None,
        labels=bool(set(job.labels) - AUTO_LABELS),
        gpu_affinity=job.gpu_affinity,
        hints=bool(job.hints),
    )


def contested(
    decision: Decision,
    jobs: Mapping[str, PendingJob],
    fleet: Sequence[WorkerState],
    waiting: int,
) -> frozenset[str] | None:
    """The workers a job the pass left waiting could use (it waits, or a preemption or
    reservation was planned for it): a grant there must end, and none may be made
    there. None: every worker (a waiting job the pass did not see, between full passes,
    or one it cannot name). A worker a waiting job could use consumes the job's logical
    queue and matches its hard constraints."""
    seen = len(decision.assignments) + len(decision.annotations)
    if seen < waiting:
        return None
    ids = {*decision.annotations, *(p.task_id for p in decision.preemptions)}
    ids |= {r.task_id for r in decision.reservations}
    ids |= {d.task_id for d in decision.denials}
    out: set[str] = set()
    kinds: set[tuple[str, str]] = set()
    for task_id in ids:
        job = jobs.get(task_id)
        if job is None:
            return None
        if (job.queue, job.class_key) in kinds:  # equal hard constraints, equal answer
            continue
        kinds.add((job.queue, job.class_key))
        out |= {w.name for w in fleet if job.queue in w.queues and match(job.req, w.caps).eligible}
    return frozenset(out)


def foreign(
    decision: Decision, jobs: Mapping[str, PendingJob], held: Mapping[str, str]
) -> frozenset[str]:
    """Grant holders (`held`, key -> worker) the pass assigns a job of another class to:
    its message would queue behind the granted backlog there, so the grant must end
    before it goes out. A job of the granted class itself keeps its place behind it."""
    keys = {worker: key for key, worker in held.items()}
    out: set[str] = set()
    for a in decision.assignments:
        mine = keys.get(a.worker)
        job = jobs.get(a.task_id)
        if mine is None:
            continue
        if job is None or grant_key(job.queue, job.band, job.class_key) != mine:
            out.add(a.worker)
    return frozenset(out)


def grants_after(
    decision: Decision,
    jobs: Mapping[str, PendingJob],
    held: Mapping[str, str],
    blocked: frozenset[str] | None,
    fleet: Sequence[WorkerState] = (),
) -> dict[str, str]:
    """The grants a pass adds, key -> worker: for each grantable class it started jobs
    of, the worker its last job went to, unless that class or worker already holds a
    grant (`held`, key -> worker), a waiting job could use that worker (`blocked`, from
    `contested`; None: every worker), or the pass took that worker's last free pool
    process (`fleet`, as the pass found it: the class's next job would wait there for a
    process, where the scheduler would start it on another worker). At most one class
    per worker, so that the jobs queued on a worker never compete with another class's."""
    if blocked is None:
        return {}
    busy = set(held.values()) | blocked | _processes_taken(decision, fleet)
    last: dict[str, str] = {}
    for a in decision.assignments:
        job = jobs.get(a.task_id)
        if job is None or not job_grantable(job):
            continue
        last[grant_key(job.queue, job.band, job.class_key)] = a.worker
    out: dict[str, str] = {}
    for key, worker in last.items():
        if key in held or worker in busy:
            continue
        busy.add(worker)
        out[key] = worker
    return out


def _processes_taken(decision: Decision, fleet: Sequence[WorkerState]) -> set[str]:
    """Workers (of those that count processes) left without a free pool process by the
    pass's assignments."""
    started: dict[str, int] = {}
    for a in decision.assignments:
        started[a.worker] = started.get(a.worker, 0) + 1
    return {
        w.name
        for w in fleet
        if w.free.processes is not None and w.free.processes - started.get(w.name, 0) < 1
    }


def to_revoke(
    held: Mapping[str, str],
    live: Sequence[str],
    backlog: Mapping[str, int],
    room_elsewhere: Mapping[str, bool],
    stale: frozenset[str] = frozenset(),
) -> list[str]:
    """The grants to end now, key list: the holder left (`live` lacks it), jobs are
    queued on the holder (`backlog`, by worker) while another worker could start one of
    the class now (`room_elsewhere`, by key), or a job sent under the grant has waited
    on its holder longer than the grant allows (`stale`, workers).

    A job that waits longer than `ojs_ml_grant_wait_s` is the scheduler's to order,
    annotate and place. A pass that leaves a job waiting also ends the grants of the
    workers it could use (`contested`); the leader takes the jobs queued under an ended
    grant back into the pending set."""
    alive = set(live)
    return [
        key
        for key, worker in held.items()
        if worker not in alive
        or worker in stale
        or (backlog.get(worker, 0) > 0 and room_elsewhere.get(key, False))
    ]
