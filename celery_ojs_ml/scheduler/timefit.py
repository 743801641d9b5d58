"""Best fit in time: where a job with a time limit starts among a group's large workers.

Key decision (measured on the trace replay, docs/performance.md "Trace replay, time
mode"): placement by score alone packs small jobs onto the fullest large worker whatever
their lengths, so one long job on each of several 8-GPU workers keeps every one of them
from draining for a large job for hours. Within a group of interchangeable workers
(equal capabilities and queues), a job with a time limit therefore goes where it makes a
large worker drain later by the fewest whole `DELAY_STEP_S` steps before the placement
score is compared; the group itself still competes with other groups by its best
placement score, so a scarce kind of worker does not draw long jobs away from the others
for being busy longest. A large worker has at least half the GPUs of the fleet's
largest; jobs without a limit are placed by score alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from celery_ojs_ml.scheduler.candidates import Key, RankKey, Ties
from celery_ojs_ml.scheduler.model import Policy
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot

T = TypeVar("T")

DELAY_STEP_S = 3600.0
"""A start that delays a large worker's drain ranks below every start in its group that
delays one by fewer steps of this many seconds (1,800-7,200 s gave equal idle figures)."""
HOLD_STEPS = 4
"""A start that delays a large worker's drain by this many steps or more holds it: such a
job is deferred (`scheduler.defer`), and at its second turn a place in any group that
holds no drain ranks first (`offer_in_time`'s `spare`; 2-8 gave equal idle figures)."""


def large(gpu_count: int | None, largest: int) -> bool:
    """A worker with at least half the GPUs of the fleet's largest: one a large job drains."""
    return 2 * (gpu_count or 0) >= max(largest, 2)


def holds_drain(ask: Ask, policy: Policy) -> bool:
    """Whether the job, once started, keeps a worker from draining: one with a time limit,
    unless it is a preemptible spot job and preemption is on (`Slot.drain_at`)."""
    return ask.end is not None and not (policy.preemption and ask.yields_drain)


def delay_steps(drain_at: float, now: float, end: float) -> int:
    """Steps of `DELAY_STEP_S`, rounded up, by which a job ending at `end` makes a worker
    that drains at `drain_at` (its running jobs' last end) drain later."""
    late = end - max(drain_at, now)
    return math.ceil(late / DELAY_STEP_S) if late > 0 else 0


def late_on(ask: Ask, policy: Policy, slot: Slot, now: float) -> int:
    """`delay_steps` of the job started now on `slot`; 0 for one that holds no drain."""
    if ask.end is None or not holds_drain(ask, policy):
        return 0
    return delay_steps(slot.drain_at(), now, ask.end)


def offer_in_time(
    ties: Ties[RankKey, T], places: Sequence[tuple[Key, int, T]], spare: bool = False
) -> None:
    """Offer a group's places, each `(own key, delay steps, candidate)`: keyed by the
    group's best own key, then the fewest steps, then the place's own key. With `spare`
    (a deferred job's second turn), by whether the place holds a drain (`HOLD_STEPS`),
    then its own key, across groups."""
    if places:
        best = max(own for own, _, _ in places)
        for own, late, item in places:
            held = late >= HOLD_STEPS
            ties.offer((own[0], -float(held), 0, *own) if spare else (*best, -late, *own), item)


def plain(key: Key, spare: bool = False) -> RankKey:
    """The ranking key of a place ranked by its own key alone (no delay counted)."""
    return (key[0], 0.0, 0, *key) if spare else (*key, 0, *key)


def aligned(slot: Slot, end: float | None) -> float:
    """How much of a job ending at `end` (None: never known) overlaps the time its worker
    stays busy anyway: the earlier of the two ends (higher is better).

    Among equal placements a job goes where the jobs already running outlast
    it, so a long job joins other long ones and the workers that drain soon
    stay free to drain for a large job (best fit in time).
    """
    return min(slot.drain_at(), math.inf if end is None else end)
