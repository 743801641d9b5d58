"""Gang placement (Flux RFC 25 `node>slot`): all ranks at once on distinct workers, or none."""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.scheduler import PendingJob, Policy, schedule
from tests.scheduler.helpers import NOW, job, running, worker


def ranks(gid: str, size: int, **attrs: object) -> list[PendingJob]:
    return [
        replace(job(f"{gid}-{r}", at=1, **attrs), gang=gid, gang_size=size, rank=r)
        for r in range(size)
    ]


def test_a_gang_is_placed_whole_on_distinct_workers() -> None:
    fleet = [worker("a"), worker("b"), worker("c")]
    decision = schedule(ranks("g", 2, gpu_count=2), fleet, NOW, Policy())
    placed = decision.assigned()
    assert sorted(placed) == ["g-0", "g-1"]
    assert len(set(placed.values())) == 2, "two ranks on one worker"


def test_a_gang_that_does_not_fit_whole_places_no_rank_and_waits_with_one_reason() -> None:
    """Only one worker has room: best fit alone would start rank 0 there."""
    fleet = [worker("a"), worker("b", jobs=[running("x", gpu_count=8, limit=60)])]
    decision = schedule(ranks("g", 2, gpu_count=4), fleet, NOW, Policy())
    assert decision.assignments == ()
    reasons = {decision.annotations[t].reason_pending for t in ("g-0", "g-1")}
    assert len(reasons) == 1 and "1/2 ranks can be placed now" in reasons.pop()


def test_single_jobs_behind_a_gang_in_order_see_what_the_gang_took() -> None:
    fleet = [worker("a"), worker("b")]
    pending = [*ranks("g", 2, gpu_count=8), job("solo", at=2, gpu_count=1)]
    decision = schedule(pending, fleet, NOW, Policy())
    assert sorted(decision.assigned()) == ["g-0", "g-1"]
    assert "solo" in decision.annotations


def test_a_gang_with_a_rank_missing_waits_for_it() -> None:
    fleet = [worker("a"), worker("b")]
    decision = schedule(ranks("g", 2, gpu_count=1)[1:], fleet, NOW, Policy())
    assert decision.assignments == ()
    assert "1/2 ranks are waiting" in decision.annotations["g-1"].reason_pending


def test_a_gang_whose_rank_sits_out_a_give_back_waits_for_it() -> None:
    """A rank in its back-off (`not_before`) is not placed, so neither is its gang."""
    fleet = [worker("a"), worker("b")]
    backed_off = [
        replace(r, not_before=NOW + 0.5) if r.rank == 0 else r for r in ranks("g", 2, gpu_count=1)
    ]
    decision = schedule(backed_off, fleet, NOW, Policy())
    assert decision.assignments == ()
    later = schedule(backed_off, fleet, NOW + 0.6, Policy())
    assert sorted(later.assigned()) == ["g-0", "g-1"]
