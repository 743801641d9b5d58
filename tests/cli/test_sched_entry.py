"""`status` / `explain` entries of pending-set records (`cli.sched.entry`)."""

from __future__ import annotations

from celery_ojs_ml.cli.sched import entry

META = {"task": "ml.infer", "queue": "celery", "band": "on-demand", "submitted_at": 5.0}


def test_a_job_delivered_ahead_is_shown_waiting_with_its_reason_estimate_and_worker() -> None:
    """The scheduler's contract: a waiting job has a `reason_pending` and a `t_estimate`. A job
    sent ahead to a gate (`ojs_ml_prefetch`) is assigned in the store but still waits."""
    note = {"reason_pending": "gpu_count free 0 < 1; delivered ahead to w", "t_estimate": 9.0,
            "worker": "w", "ahead": True}  # fmt: skip
    shown = entry({"state": "assigned", "worker": "w", "annotation": note, "meta": META})
    assert shown["state"] == "pending" and shown["ahead"] is True
    assert shown["reason_pending"] == note["reason_pending"] and shown["t_estimate"] == 9.0
    assert shown["worker"] == "w"


def test_an_assignment_about_to_start_is_shown_assigned_without_a_stale_reason() -> None:
    """A job assigned to start now keeps the annotation of the passes it waited through;
    it is shown `assigned`, without that reason or estimate."""
    note = {"reason_pending": "gpu_count free 0 < 1", "t_estimate": 9.0, "worker": "v"}
    shown = entry({"state": "assigned", "worker": "w", "annotation": note, "meta": META})
    assert shown["state"] == "assigned" and shown["ahead"] is False
    assert shown["reason_pending"] is None and shown["t_estimate"] is None
    assert shown["worker"] == "w"
