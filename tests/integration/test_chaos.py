"""A short chaos campaign (DESIGN invariant 5): under overlapping faults of every kind,
no job is lost, none runs twice at the same time, and no checkpointed job completes twice.

`bench/chaos.py` at 1.5 minutes: four real prefork workers, a broker and a store with
an AOF, a mixed workload of checkpointed training in every band, short inference and
one 2-rank gloo gang,
and meanwhile SIGKILLed workers, a stalled main process, a killed scheduler leader,
restarts of the store and of the broker, and a worker cut off from the store, each
longer than the lease TTL where that matters. Nothing is tolerated: the campaign's own
records (a ledger server no fault touches) must show every job completed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import run_campaign
from bench.chaos_faults import KINDS, MIN_KILLS

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_a_short_chaos_campaign_loses_no_job_and_runs_none_twice_at_once(tmp_path: Path) -> None:
    report = run_campaign(1.5, seed=1, workdir=tmp_path, drain_s=240, gangs=1)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1, default=str))
    summary, verdict = report["summary"], report["verdict"]
    where = f"report and worker logs in {tmp_path}"
    assert report["fault_errors"] == [], where
    assert all(report["faults"][kind] >= 1 for kind in KINDS), (report["faults"], where)
    assert report["faults"]["kill"] >= MIN_KILLS, where
    assert summary["lost"] == [], where
    assert summary["overlaps"] == [], where
    assert summary["failed"] == [], where
    doubles = [d for d in summary["double_completions"] if d["kind"] == "train"]
    assert doubles == [], where
    assert summary["ran_but_not_published"] == [] and report["refused_but_ran"] == [], where
    train = summary["by_kind"]["train"]
    assert train["completed"] == train["published"] >= 10, (train, where)
    assert train["reruns"] >= 1, "no training job was interrupted: the faults missed the jobs"
    gang = summary["by_kind"]["gang"]
    assert gang["completed"] == gang["published"] == 2, (gang, where)
    assert verdict["pass"], (verdict, where)
