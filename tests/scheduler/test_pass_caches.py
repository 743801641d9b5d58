"""What one pass keeps to decide 100,000 jobs cheaply changes no decision: the best buckets
brought up to date as buckets open and close (`candidates.BestBuckets`), asks derived once
per requirements object (`order.Asks`), preemption search orders shared by kinds of job with
the same band and eligible groups (`Preemptor._order`), and pending messages shared by alike
jobs (`Annotator.reason`). Each is checked against the same thing computed afresh."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import Hints
from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.scheduler.annotate import Annotator
from celery_ojs_ml.scheduler.candidates import BestBuckets, Candidate, Group, Key, Ties
from celery_ojs_ml.scheduler.order import Ask, Asks
from celery_ojs_ml.scheduler.preempt import Cost, Preemptor, lost_work_s
from celery_ojs_ml.scheduler.score import PlacementScore
from celery_ojs_ml.scheduler.slot import Shape
from tests.scheduler.helpers import NOW, decide, decision_facts, job, running, worker


def _shape(n: int) -> Shape:
    return ((float(n % 5), 8.0, 64.0, 0.0, float(n % 2)), (), n == 0, None, None)


def _score(kid: int, ask: Ask, group: Group, shape: Shape) -> PlacementScore | None:
    """Fits where the free GPUs are not 1; scores by free GPUs (so buckets tie)."""
    gpus = shape[0][0]
    return None if gpus == 1 else PlacementScore(-abs(gpus - 2 - kid), 0, 0, 0, 0, 0)


class _Scorer:
    """`_score` as a bound method: `BestBuckets` holds its view's method weakly."""

    def score(self, kid: int, ask: Ask, group: Group, shape: Shape) -> PlacementScore | None:
        return _score(kid, ask, group, shape)


def _afresh(kid: int, group: Group) -> tuple[Key | None, set[int]]:
    ties: Ties[Key, Candidate] = Ties()
    for shape, members in group.buckets.items():
        score = _score(kid, None, group, shape)  # type: ignore[arg-type]
        if score is not None:
            ties.offer((shape[0][4] >= 1, score.total), (group, shape, members, score, None))
    return ties.key, {id(c[2]) for c in ties.items}


@pytest.mark.parametrize("seed", range(20))
def test_best_buckets_follow_buckets_opening_and_closing(seed: int) -> None:
    rng = random.Random(seed)
    group = Group(0, Capabilities(), "", frozenset({"celery"}))
    scorer = _Scorer()
    best = BestBuckets(scorer.score)
    shapes = [_shape(n) for n in range(12)]
    for _ in range(300):
        shape = rng.choice(shapes)
        if shape in group.buckets and rng.random() < 0.6:
            del group.buckets[shape]
            group.changes.append((shape, None))
        elif shape not in group.buckets:
            group.buckets[shape] = members = {rng.randrange(100): None}
            group.changes.append((shape, members))
        if rng.random() < 0.4:
            kid = rng.randrange(3)
            top, items = best.of(kid, None, group)  # type: ignore[arg-type]
            assert (top, {id(c[2]) for c in items}) == _afresh(kid, group)


def test_asks_derive_as_ask_of() -> None:
    asks = Asks(NOW)
    shared = job("a", limit=600, gpu_count=2, model_id="llama-3.1-8b")
    twin = PendingJob("b", shared.req, time_limit_s=None, band="spot")
    hinted = PendingJob("c", shared.req, hints=Hints(spot_preference="spot_preferred"))
    for pending in (shared, twin, hinted, shared):
        assert asks.of(pending) == Ask.of(pending, NOW)
    order = (0, 5, 0.0, "z")
    assert asks.of(twin, order) == Ask.of(twin, NOW, order)


def _random_pass(seed: int) -> tuple[list[PendingJob], list[WorkerState]]:
    rng = random.Random(seed)
    profiles = ("nvidia-a100x8", "nvidia-a100x2", "nvidia-l4x1", "cpu")
    fleet = []
    for i in range(24):
        profile = rng.choice(profiles)
        gpus = 0 if profile == "cpu" else 1
        busy = [
            running(
                f"r{i}-{k}", started=NOW - rng.uniform(0, 3600), gpu_count=gpus,
                limit=rng.choice((None, 600, 3600)), checkpoint=NOW - rng.uniform(0, 600),
                priority_class=rng.choice(("spot", "spot", "on-demand")),
            )
            for k in range(rng.randint(0, 1 if profile.endswith(("x1", "x2")) else 6))
        ]  # fmt: skip
        fleet.append(worker(f"w{i:02d}", profile, busy))
    kinds = ({"gpu_count": 1}, {"gpu_count": 2}, {"cpu_cores": 4}, {"gpu_count": 4})
    pending = [
        job(
            f"j{n:03d}", at=n, limit=rng.choice((None, 300, 600, 1800)),
            priority_class=rng.choice(("spot", "on-demand", "reserved")),
            gpu_affinity=rng.choice(("pack", "spread")), **rng.choice(kinds),
        )
        for n in range(150)
    ]  # fmt: skip
    return pending, fleet


def _own_order(self: Preemptor, key: tuple[object, ...], ask: Ask) -> list[tuple[Cost, int]]:
    """Each kind of job's order built from its own eligible workers."""
    out = []
    for group in self.view.eligible(ask.job):
        for idx in group.members:
            found = self._candidates_on(self.view.slots[idx], ask.job.band)
            if found:
                low = min(rank(v.band) for v in found)
                out.append(((low, min(lost_work_s(v, self.view.now) for v in found), 0, idx), idx))
    return sorted(out)


@pytest.mark.parametrize("seed", range(8))
def test_shared_orders_and_messages_decide_as_computed_per_job(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pending, fleet = _random_pass(seed)
    kept = decide(pending, fleet, reservation_depth=2)
    monkeypatch.setattr(Preemptor, "_order", _own_order)
    monkeypatch.setattr(Annotator, "reason", Annotator._reason)
    afresh = decide(pending, fleet, reservation_depth=2)
    assert decision_facts(kept) == decision_facts(afresh)
    assert kept.preemptions and kept.reservations and kept.annotations  # it did decide


def test_the_reservation_holder_keeps_its_own_message() -> None:
    """A job sitting out a back-off holds a worker it fits now; an alike job behind it
    waits for that reservation: the same needs and end, not the same message."""
    fleet = [worker("w", "nvidia-a100x2")]
    held = replace(job("a", at=0, gpu_count=2), not_before=NOW + 60)
    found = decide([held, job("b", at=1, gpu_count=2)], fleet, reservation_depth=1)
    assert [r.task_id for r in found.reservations] == ["a"]
    reasons = {t: a.reason_pending for t, a in found.annotations.items()}
    assert "reserved for a" in reasons["b"] and "reserved" not in reasons["a"]


def test_a_pass_leaves_no_reference_cycle_for_the_collector() -> None:
    """A pass's view is freed by reference counting as the pass ends: a cycle through it
    (the view's bound method in its own `BestBuckets`) left every worker state, slot and
    timeline of every pass to the cyclic collector, 0.4 s a pass at 10,000 workers."""
    import gc

    from tests.scheduler.helpers import decide, job, running, worker

    fleet = [worker(f"w{i}", jobs=[running(f"r{i}", gpu_count=2, limit=3600.0)])
             for i in range(20)]  # fmt: skip
    jobs = [job(f"j{i}", limit=600.0, gpu_count=1 + i % 8) for i in range(200)]
    gc.collect()
    gc.disable()
    try:
        decision = decide(jobs, fleet)
        assert 0 < len(decision.assignments) < len(jobs), "the pass placed some, left some"
        assert gc.collect() == 0, "no cyclic garbage left by the pass"
    finally:
        gc.enable()


def test_workers_opened_to_reservations_are_made_once_per_worker_state() -> None:
    """With a reservation to place, every worker also consumes the reservations' queue;
    with the pass memo, an unchanged worker's opened state is the one made last pass."""
    from celery_ojs_ml.scheduler.memo import Memo
    from celery_ojs_ml.scheduler.pools import open_queues
    from tests.scheduler.helpers import worker

    memo = Memo()
    fleet = [worker("a"), worker("b")]
    first = open_queues(fleet, memo)
    assert all(w.queues > f.queues for w, f in zip(first, fleet, strict=True))
    again = open_queues([fleet[0], worker("b")], memo)
    assert again[0] is first[0], "unchanged: kept"
    assert again[1] is not first[1] and again[1] == first[1], "a new state: made again"
    assert len(memo._derived) == 2, "only the last call's are kept"
    assert open_queues(fleet) == first
