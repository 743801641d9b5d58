"""When a pass may stop early (`Policy.settle`, `core.Planner.settled`).

Under a backlog on a full fleet, every pass after a job ends decided up to
`queue_depth` jobs that could only wait again (in `bench/dispatch.py`'s bursts,
`schedule` was 42% of the leader's samples). Slurm's main scheduler likewise
stops at the first job that cannot start and leaves the rest to its periodic
backfill pass; here the full pass every `ojs_ml_full_pass_s` decides them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.scheduler.model import PendingJob, Policy, RunningJob
from celery_ojs_ml.scheduler.slot import Slot
from celery_ojs_ml.spec.resources import gpu_share

_ABOVE_EVERY_BAND = 99


def may_settle(
    policy: Policy, alike: Sequence[tuple[PendingJob, int]], inflight: Mapping[str, object]
) -> bool:
    """Whether a pass may stop early (`core.Planner.settled`): fleet order (not fair order,
    which does not put bands first), no preemption in flight (its job claims what
    its victims free), and every pending job needs whole GPUs (a CPU job or a GPU
    share could still fit where no whole GPU is free)."""
    if policy.weights or inflight:
        return False
    return all(
        int(job.req.ext_ml_gpu_count or 0) >= 1 and gpu_share(job.req) is None for job, _ in alike
    )


def lowest_band(slots: Sequence[Slot]) -> int:
    """The rank of the lowest band among preemptible running jobs (a job ranked above
    it could preempt); above every band when none runs."""
    return lowest_preemptible(r for s in slots for r in s.state.running)


def lowest_preemptible(running: Iterable[RunningJob]) -> int:
    """`lowest_band` of these running jobs: a job whose band ranks above it may preempt."""
    return min((rank(r.band) for r in running if r.preemptible), default=_ABOVE_EVERY_BAND)


def settling(
    policy: Policy,
    alike: Sequence[tuple[PendingJob, int]],
    inflight: Mapping[str, object],
    slots: Sequence[Slot],
) -> tuple[bool, int]:
    """Whether the pass may stop early, and the lowest preemptible running band's rank."""
    if not (policy.settle and may_settle(policy, alike, inflight)):
        return False, 0
    return True, lowest_band(slots)
