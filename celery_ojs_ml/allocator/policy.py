"""The allocator's pure rules: counted-resource reasons, backfill and victim choice.

Key decisions:

* **Backfill.** Held requests are served in strict priority order (band, then
  priority, then FIFO). A request behind a waiting one starts only inside what is
  left after setting aside the *whole* demand of every waiting request ahead of it
  (`blocker`): conservative backfill, without run-time estimates.
* **Victims.** Lowest band first, then most recently started first (least work
  lost), pruned to a minimal set (`choose_victims`). A job whose preemption policy
  is `never`, or preempted `ojs_ml_max_preemptions` times, is never a victim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from celery_ojs_ml.allocator.devices import Peers, largest_peer_set
from celery_ojs_ml.allocator.model import RESOURCE_NAMES, Allocation, Demand, Pending, rank
from celery_ojs_ml.matching import Reason, Verdict
from celery_ojs_ml.matching.filters import fmt
from celery_ojs_ml.spec.resources import MLRequirements

V = TypeVar("V")
NEVER = "never"
"""The `ext_mlx_scheduling_preemption_policy` that exempts a job from preemption."""


def counted_reasons(want: Demand, total: Demand, free: Demand) -> list[Reason]:
    """Matching's reasons for the four counted resources: NEVER over the total, WAIT over free."""
    out: list[Reason] = []
    for (name, asked), (_, cap), (_, left) in zip(
        want.items(), total.items(), free.items(), strict=True
    ):
        resource = RESOURCE_NAMES[name]
        if asked <= 0:
            continue
        if asked > cap:
            template = f"{resource} {fmt(cap)} < {{r}}"
            out.append(Reason(resource, asked, left, cap, Verdict.NEVER, template))
        elif asked > left:
            template = resource + " free {a} < {r}"
            out.append(Reason(resource, asked, left, cap, Verdict.WAIT, template))
    return out


def peer_reasons(
    count: int, peers: Peers, devices: int, taken: set[int], most: int
) -> list[Reason]:
    """`gpu_interconnect` for a job whose `count` GPUs must be NVLink peers: NEVER when the
    worker has no such set (`most`: its largest), WAIT when none is free (`taken` busy)."""
    if count > most:
        return [Reason("gpu_interconnect", count, most, most, Verdict.NEVER, _PEERS_NEVER)]
    free = largest_peer_set((i for i in range(devices) if i not in taken), peers)
    if count > free:
        return [Reason("gpu_interconnect", count, free, most, Verdict.WAIT, _PEERS_WAIT)]
    return []


_PEERS_NEVER = "gpu_interconnect: NVLink-peer GPUs {a} < {r}"
_PEERS_WAIT = "gpu_interconnect: NVLink-peer GPUs free {a} < {r}"


def blocker(want: Demand, free: Demand, ahead: Sequence[Pending]) -> str | None:
    """Why backfill may not start `want` now, or None when it may (see module doc)."""
    set_aside = Demand.total(Demand.of(p.req) for p in ahead)
    short = want.short_of(free.minus(set_aside))
    if not short:
        return None
    names = [RESOURCE_NAMES[s] for s in short]
    for p in ahead:
        if set(short) & _uses(Demand.of(p.req)):
            return f"behind held {p.task_id} ({p.band}) waiting for {', '.join(names)}"
    return "behind held requests waiting for " + ", ".join(names)


def _uses(d: Demand) -> set[str]:
    return {name for name, amount in d.items() if amount > 0}


def with_preemption_limits(
    req: MLRequirements,
    *,
    policy: str | None = None,
    preemptions: int = 0,
    max_preemptions: int | None = None,
) -> MLRequirements:
    """`req` made not preemptible when its policy is `never` or it hit the cap.

    The policy is `ext_mlx_scheduling_preemption_policy` (OJS ML Extensions §7), the cap
    `ojs_ml_max_preemptions`. Both are folded into the requirements the job runs under,
    so victim choice and the capacity a higher band may preempt see one flag (§8.2's).
    The same object when nothing applies (or it is not preemptible anyway).
    """
    capped = max_preemptions is not None and preemptions >= max_preemptions
    if req.ext_ml_preemptible is False or not (policy == NEVER or capped):
        return req
    return req.model_copy(update={"ext_ml_preemptible": False})


def is_victim(alloc: Allocation, band: str, *, allow_on_demand: bool) -> bool:
    """Whether `alloc` may be preempted for a request in `band` (§8.1, §8.2).

    Only preemptible jobs in a lower band qualify; an on-demand job only for a
    reserved request and only when the worker allows on-demand preemption.
    """
    if not alloc.preemptible or rank(alloc.band) >= rank(band):
        return False
    return alloc.band != "on-demand" or allow_on_demand


def choose_victims(
    candidates: Sequence[Allocation], fits: Callable[[Sequence[Allocation]], bool]
) -> list[Allocation] | None:
    """A minimal victim set in policy order (see module doc), or None if none suffices."""
    return minimal_set(sorted(candidates, key=lambda a: (rank(a.band), -a.started_at)), fits)


def minimal_set(ordered: Sequence[V], fits: Callable[[Sequence[V]], bool]) -> list[V] | None:
    """Take `ordered` until `fits`, then spare each one not needed, last taken first; None
    if even all of them do not suffice. The worker's victims and the fleet scheduler's
    preemption plans (`scheduler.preempt`) are both chosen by it."""
    chosen: list[V] = []
    for candidate in ordered:
        if fits(chosen):
            break
        chosen.append(candidate)
    if not fits(chosen):
        return None
    for victim in reversed(list(chosen)):
        rest = [v for v in chosen if v is not victim]
        if fits(rest):
            chosen = rest
    return chosen
