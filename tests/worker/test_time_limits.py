"""Run-time limits the fleet scheduler estimates ends and backfill from: an
`ext_ml_timeout_seconds`, else the hard limit Celery enforces (the message's
`timelimit`, the task's `time_limit`, `task_time_limit`). A soft limit alone is no end:
a task may catch `SoftTimeLimitExceeded` and go on, so backfilling on it could delay a
reserved start."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.leader.fleet_view import _running
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.worker.setup import hard_time_limit


@pytest.mark.parametrize(
    ("timelimit", "task_limit", "conf_limit", "expected"),
    [
        ([60, 30], None, None, 60.0),
        ((45, None), None, None, 45.0),
        ([None, 30], None, None, None),  # soft alone
        ([None, None], 90, None, 90.0),  # the task's own time_limit
        (None, None, 120, 120.0),  # the app's task_time_limit
        ([None, 30], None, 120, 120.0),
        ([True, None], None, None, None),
        ([-5, None], None, None, None),
        (["60", None], None, None, None),
        ("60", None, None, None),
    ],
)
def test_the_hard_limit_comes_from_the_message_then_the_task_then_the_app(
    timelimit: Any, task_limit: Any, conf_limit: Any, expected: float | None
) -> None:
    task = SimpleNamespace(time_limit=task_limit)
    conf = SimpleNamespace(task_time_limit=conf_limit)
    assert hard_time_limit(timelimit, task, conf) == expected


def _parse(headers: Any) -> Any:
    return normalize({k: v for k, v in headers.items() if k.startswith("ext_ml")}).requirements


def test_a_leases_celery_time_limit_is_the_running_jobs_end_unless_ext_ml_timeout_is_set() -> None:
    lease = {"task_id": "t", "headers": {"ext_ml_gpu_count": 1}, "started_at": 100.0}
    assert _running(lease, _parse, None).ends_at is None, "no limit: no end"  # type: ignore[union-attr]
    job = _running({**lease, "time_limit_s": 30}, _parse, None)
    assert job is not None and job.ends_at == 130.0
    own = {**lease, "headers": {"ext_ml_gpu_count": 1, "ext_ml_timeout_seconds": 10}}
    job = _running({**own, "time_limit_s": 30}, _parse, None)
    assert job is not None and job.ends_at == 110.0, "ext_ml_timeout_seconds is the job's own"
    for foreign in (True, -1, "30", None):
        job = _running({**lease, "time_limit_s": foreign}, _parse, None)
        assert job is not None and job.ends_at is None, foreign


def test_a_waiting_jobs_duration_for_backfill_is_its_hard_limit_not_a_soft_one() -> None:
    """The leader's pending record (`intake.pending_meta`): a job backfills only if its own
    limit ends before the reserved start, so the limit must be one Celery enforces."""
    from celery_ojs_ml.leader.intake import pending_meta

    def meta(headers: dict[str, Any], conf_limit: Any = None) -> Any:
        conf = SimpleNamespace(task_time_limit=conf_limit)
        return pending_meta(headers, {}, conf)["time_limit_s"]

    assert meta({"ext_ml_timeout_seconds": 20, "timelimit": [20, None]}) == 20
    assert meta({"timelimit": [60, 30]}) == 60.0
    assert meta({"timelimit": [None, 30]}) is None, "a soft limit alone is no bound"
    assert meta({"timelimit": [None, None]}, conf_limit=300) == 300.0
    assert meta({"ext_ml_timeout_seconds": True, "timelimit": [None, None]}) is None
