"""A pass remembers the needs that found no worker (`scheduler.nofit`) and decides exactly
as it would without the memo: capacity only shrinks within a pass, except when a
preemption moves its victims' ends, which empties the memo."""

from __future__ import annotations

import random

import pytest

from celery_ojs_ml.scheduler import Decision, PendingJob, WorkerState
from celery_ojs_ml.scheduler.nofit import NoFit
from celery_ojs_ml.scheduler.order import Ask
from tests.scheduler.helpers import NOW, decide, job, running, worker


def _random_pass(seed: int) -> tuple[list[PendingJob], list[WorkerState]]:
    rng = random.Random(seed)
    profiles = ("nvidia-a100x8", "nvidia-a100x2", "nvidia-l4x1", "nvidia-h100x8")
    fleet = []
    for i in range(12):
        profile = rng.choice(profiles)
        busy = [
            running(
                f"r{i}-{k}", started=NOW - rng.uniform(0, 900), limit=rng.choice((None, 1200)),
                gpu_count=1, priority_class=rng.choice(("spot", "on-demand")),
            )
            for k in range(rng.randint(0, 2 if profile.endswith("x2") else 1))
        ]  # fmt: skip
        fleet.append(worker(f"w{i}", profile, busy))
    pending = [
        job(
            f"j{n}", at=n, limit=rng.choice((None, 60, 600, 6000)),
            gpu_count=rng.choice((1, 1, 2, 4, 8)),
            priority_class=rng.choice(("spot", "on-demand", "on-demand", "reserved")),
        )
        for n in range(150)
    ]  # fmt: skip
    return pending, fleet


def _facts(decision: Decision) -> tuple[object, ...]:
    return (
        sorted((a.task_id, a.worker) for a in decision.assignments),
        sorted((r.task_id, r.worker, r.start) for r in decision.reservations),
        sorted((p.task_id, p.worker, p.victims) for p in decision.preemptions),
        sorted((t, a.reason_pending, a.t_estimate) for t, a in decision.annotations.items()),
    )


@pytest.mark.parametrize("seed", range(8))
def test_a_pass_with_the_memo_decides_exactly_as_one_without(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pending, fleet = _random_pass(seed)
    with_memo = decide(pending, fleet)
    monkeypatch.setattr(NoFit, "known", lambda self, ask: False)
    without = decide(pending, fleet)
    assert _facts(with_memo) == _facts(without)
    assert with_memo.assignments and with_memo.annotations  # the passes did decide


def test_the_random_passes_preempt_and_reuse_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The equivalence above covers passes that preempt, and the memo is used in them."""
    used, real = [0], NoFit.known

    def counting(self: NoFit, ask: Ask) -> bool:
        found = real(self, ask)
        used[0] += found
        return found

    monkeypatch.setattr(NoFit, "known", counting)
    preempting = 0
    for seed in range(8):
        pending, fleet = _random_pass(seed)
        preempting += bool(decide(pending, fleet).preemptions)
    assert preempting >= 4 and used[0] > 100


def test_a_longer_job_with_the_same_needs_is_known_not_to_fit_and_a_shorter_one_is_not() -> None:
    memo = NoFit()
    short, longer, shorter = (
        Ask.of(job(t, gpu_count=2, limit=limit), NOW)
        for t, limit in (("a", 600.0), ("b", 6000.0), ("c", 60.0))
    )
    memo.record(short)
    assert memo.known(longer) and memo.known(short)
    assert not memo.known(shorter)  # it may fit before a reservation
    assert not memo.known(Ask.of(job("d", gpu_count=1, limit=6000.0), NOW))  # other needs
    assert not memo.known(Ask.of(job("e", gpu_count=2, limit=6000.0, queue="train"), NOW))
    memo.forget()
    assert not memo.known(longer)
