"""The start-now search (`FleetView.fit_now`) keeps per-bucket fit checks and picks, ranks
only the candidates that reach the best (free process, score), takes a bucket's first worker
when it outlasts the job, and keeps each reserved worker's lowest free level per version: a
pass decides exactly as one that ranks every candidate afresh, each bucket's drain times
indexed anew (the search before those caches)."""

from __future__ import annotations

import math
import random

import pytest

from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.scheduler.candidates import Key, RankKey, Ties
from celery_ojs_ml.scheduler.drains import Drains
from celery_ojs_ml.scheduler.fleet import FleetView, aligned
from celery_ojs_ml.scheduler.model import Policy
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.score import PlacementScore, Workload
from celery_ojs_ml.scheduler.slot import Hold, Slot
from celery_ojs_ml.scheduler.timefit import HOLD_STEPS, delay_steps, holds_drain, large
from celery_ojs_ml.scheduler.vectors import covers
from tests.scheduler.helpers import NOW, decide, decision_facts, job, running, worker

PROFILES = ("nvidia-a100x8", "nvidia-a100x2", "nvidia-l4x1", "nvidia-h100x8", "cpu")
KINDS = (
    {"gpu_count": 1},
    {"gpu_count": 2, "cpu_cores": 8, "memory_gb": 64},
    {"gpu_count": 4, "gpu_interconnect": "nvlink"},
    {"cpu_cores": 4, "memory_gb": 16},
    {"gpu_count": 1, "gpu_type": "nvidia-l4"},
)


def _random_pass(seed: int) -> tuple[list[PendingJob], list[WorkerState]]:
    rng = random.Random(seed)
    fleet = []
    for i in range(30):
        profile = rng.choice(PROFILES)
        busy = [
            running(
                f"r{i}-{k}", started=NOW - rng.uniform(0, 900),
                limit=rng.choice((None, 600, 1200, 3600)), gpu_count=0 if profile == "cpu" else 1,
                priority_class=rng.choice(("spot", "on-demand")),
            )
            for k in range(rng.randint(0, 1 if profile.endswith("x1") else 2))
        ]  # fmt: skip
        fleet.append(worker(f"w{i:02d}", profile, busy))
    pending = [
        job(
            f"j{n:03d}", at=n, limit=rng.choice((None, 60, 300, 600, 1800, 6000)),
            priority_class=rng.choice(("spot", "on-demand", "on-demand", "reserved")),
            gpu_affinity=rng.choice(("pack", "pack", "spread")), **rng.choice(KINDS),
        )
        for n in range(200)
    ]  # fmt: skip
    return pending, fleet


def _every_candidate(
    view: FleetView, ask: Ask, spare: bool = False
) -> tuple[Slot, PlacementScore] | None:
    """The search ranking every bucket's pick and every reserved worker afresh; with
    `spare` (a deferred job's second turn), a place that holds a large worker's drain
    ranks below every one that holds none, across groups, before the score."""
    if view.nofit.known(ask):
        return None
    best: tuple[object, ...] | None = None
    found: tuple[Slot, PlacementScore] | None = None
    for group in view.eligible(ask.job):
        places = [
            view.slots[_drains(view, members).pick(math.inf if ask.end is None else ask.end)]
            for shape, members in group.buckets.items()
            if view.fits(ask, group, shape)
        ]
        for i in group.reserved:
            slot = view.slots[i]
            if (
                not slot.closed
                and view.fits(ask, group, slot.shape())
                and _backfills(view, ask, slot)
            ):
                places.append(slot)
        # best fit in time: a timed job on large workers (`scheduler.timefit`)
        timed = ask.end is not None and large(group.caps.gpu_count, view.workload.largest)
        ranked = []
        for slot in places:
            score = view.score(ask, group, slot.shape())
            held = ask.end and timed and holds_drain(ask, view.policy)  # not a spot job
            late = delay_steps(slot.drain_at(), view.now, ask.end) if ask.end and held else 0
            ranked.append(((slot.free[4] >= 1, score.total), late, slot, score))
        top = max((own for own, _, _, _ in ranked), default=None)
        for own, late, slot, score in ranked:
            group_key = top if timed and top is not None else own
            lead = (own[0], -float(late >= HOLD_STEPS), 0) if spare else (*group_key, -late)
            rank = (*lead, *own, aligned(slot, ask.end), not slot.reserved, -slot.idx)
            if best is None or rank > best:
                best, found = rank, (slot, score)
    if found is None:
        view.nofit.record(ask)
    return found


def _drains(view: FleetView, members: dict[int, None]) -> Drains:
    """A bucket's drain times, indexed afresh."""
    return Drains((i, view.slots[i].drain_at()) for i in members)


def _backfills(view: FleetView, ask: Ask, slot: Slot) -> bool:
    """`may_backfill` from the slot's timeline, with nothing kept."""
    return covers(slot.timeline().lowest_between(view.now, ask.end), view.taken(ask, slot))


@pytest.mark.parametrize("seed", range(10))
def test_the_kept_search_decides_exactly_as_ranking_every_candidate(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pending, fleet = _random_pass(seed)
    kept = decide(pending, fleet, reservation_depth=3)
    monkeypatch.setattr(FleetView, "fit_now", _every_candidate)
    monkeypatch.setattr(FleetView, "may_backfill", _backfills)
    afresh = decide(pending, fleet, reservation_depth=3)
    assert decision_facts(kept) == decision_facts(afresh)
    assert kept.assignments and kept.reservations and kept.annotations  # it did decide


def test_the_random_passes_rank_ties_on_score_and_backfill_reserved_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The equivalence above covers ties on score across buckets (then drain times and
    fleet order decide) and backfill checks on reserved workers."""
    tied, checked = [0], [0]
    best_tied, may_backfill = FleetView._best_tied, FleetView.may_backfill

    def counting_ties(
        self: FleetView, ties: Ties[RankKey, object], end: float | None
    ) -> tuple[Slot, PlacementScore] | None:
        tied[0] += len(ties.items) > 1
        return best_tied(self, ties, end)  # type: ignore[arg-type]

    def counting_backfill(self: FleetView, ask: Ask, slot: Slot) -> bool:
        checked[0] += 1
        return may_backfill(self, ask, slot)

    monkeypatch.setattr(FleetView, "_best_tied", counting_ties)
    monkeypatch.setattr(FleetView, "may_backfill", counting_backfill)
    for seed in range(10):
        pending, fleet = _random_pass(seed)
        decide(pending, fleet, reservation_depth=3)
    assert tied[0] > 50 and checked[0] > 50


def test_ties_keep_every_candidate_of_the_highest_key_only() -> None:
    ties: Ties[Key, str] = Ties()
    ties.offer((False, 9.0), "a")
    ties.offer((True, 1.0), "b")
    ties.offer((True, 1.0), "c")
    ties.offer((True, 0.5), "d")
    assert ties.key == (True, 1.0) and ties.items == ["b", "c"]
    assert ties.below((True, 0.5)) and not ties.below((True, 1.0))
    ties.offer_all((True, 1.0), ["e"])
    ties.offer_all((True, 2.0), ["f", "g"])
    assert ties.items == ["f", "g"]


def test_a_reserved_workers_lowest_level_is_kept_only_while_it_is_unchanged() -> None:
    view = FleetView([worker("w", "nvidia-a100x8")], NOW, Policy(), Workload())
    slot = view.slots[0]
    reserve = Hold("r", ("r",), NOW + 600, None, (6.0, 0.0, 0.0, 0.0, 0.0), "reserve")
    view.hold(slot, reserve)
    short = Ask.of(job("s", limit=300, gpu_count=2), NOW)
    assert view.lowest(slot, short.end)[0] == 8.0  # the reservation starts after it ends
    assert view.may_backfill(short, slot)
    view.assign(short, slot)
    assert view.lowest(slot, short.end)[0] == 6.0
    assert view.may_backfill(Ask.of(job("t", limit=300, gpu_count=2), NOW), slot)
    assert not view.may_backfill(Ask.of(job("u", limit=300, gpu_count=7), NOW), slot)
    assert not view.may_backfill(Ask.of(job("v", limit=6000, gpu_count=3), NOW), slot)
