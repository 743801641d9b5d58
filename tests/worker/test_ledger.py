"""The leader's ledger of assignments its workers' heartbeats do not show yet (DESIGN
decision 9: "workers report, the scheduler decides"). An assignment's GPUs stay counted
until the worker's report covers the job, so the leader never hands them out twice."""

from __future__ import annotations

from collections.abc import Mapping

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.leader.ledger import Ledger
from celery_ojs_ml.store.pending import ASSIGNED, PENDING

ONE_GPU = Demand(gpus=1)


def _ledger() -> Ledger:
    ledger = Ledger()
    ledger.assigned("job", "w1", ONE_GPU, now=100.0)
    ledger.used({"job": {"state": ASSIGNED, "worker": "w1"}}, {"w1": 99.0}, {}, 100.0)
    return ledger


def _starts(at: float | None) -> object:
    def started_at(ids: list[str]) -> Mapping[str, float | None]:
        assert ids == ["job"]
        return {"job": at}

    return started_at


def test_an_assigned_job_counts_until_the_workers_report_shows_it() -> None:
    ledger = _ledger()
    used = ledger.used({"job": {"state": ASSIGNED, "worker": "w1"}}, {"w1": 101.0}, {}, 101.0)
    assert used == {"w1": ONE_GPU}
    shown = {"w1": frozenset({"job"})}
    assert ledger.used({}, {"w1": 102.0}, shown, 102.0) == {}
    assert ledger.entries == {}


def test_a_job_started_after_the_last_heartbeat_still_counts() -> None:
    """The race the bench showed: the heartbeat (ts 101) is newer than the last pass that
    saw the job assigned (100) but older than the job's start (101.5), so it still shows
    the job's GPU free; before, the leader assigned that GPU again and the gate gave the
    second job back (a 0.5 s stall)."""
    ledger = _ledger()
    used = ledger.used({}, {"w1": 101.0}, {}, 102.0, _starts(101.5))  # type: ignore[arg-type]
    assert used == {"w1": ONE_GPU}
    assert "job" in ledger.entries


def test_a_job_that_ended_before_the_heartbeat_no_longer_counts() -> None:
    ledger = _ledger()
    assert ledger.used({}, {"w1": 103.0}, {}, 104.0, _starts(101.5)) == {}  # type: ignore[arg-type]
    assert ledger.entries == {}


def test_without_a_start_time_the_last_sighting_decides_and_a_given_back_job_is_dropped() -> None:
    ledger = _ledger()
    assert ledger.used({}, {"w1": 100.5}, {}, 101.0, _starts(None)) == {}  # type: ignore[arg-type]
    again = _ledger()
    assert again.used({"job": {"state": PENDING}}, {"w1": 50.0}, {}, 101.0) == {}
    assert again.entries == {}
