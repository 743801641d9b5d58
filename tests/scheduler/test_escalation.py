"""Priority escalation, OJS ML §8.4.

§8.4: a job with `ext_ml_priority_escalation: true` that has waited longer than
`ext_ml_escalation_after_s` is scheduled as `ext_ml_escalation_target_class`
from then on (the target must rank above its own class: a validation rule).
"""

from __future__ import annotations

from celery_ojs_ml.scheduler.escalate import escalated
from tests.scheduler.helpers import NOW, decide, job, running, worker

ESC = {
    "priority_class": "spot",
    "priority_escalation": True,
    "escalation_after_s": 60,
    "escalation_target_class": "on-demand",
}


def _one_free_gpu() -> list:  # type: ignore[type-arg]
    return [worker("w1", jobs=[running("busy", gpu_count=7, limit=3600)])]


def test_a_spot_job_that_waited_past_its_escalation_time_goes_before_later_on_demand_jobs() -> None:
    pending = [
        job("esc", at=NOW - 61, gpu_count=1, **ESC),
        job("od", at=NOW - 10, gpu_count=1, priority_class="on-demand"),
    ]
    decision = decide(pending, _one_free_gpu())
    assert decision.assigned() == {"esc": "w1"}
    assert decision.escalations == {"esc": "spot"}


def test_before_its_escalation_time_the_job_keeps_its_own_class() -> None:
    pending = [
        job("esc", at=NOW - 59, gpu_count=1, **ESC),
        job("od", at=NOW - 10, gpu_count=1, priority_class="on-demand"),
    ]
    decision = decide(pending, _one_free_gpu())
    assert decision.assigned() == {"od": "w1"}
    assert decision.escalations == {}
    assert "escalated" not in decision.annotations["esc"].reason_pending


def test_a_waiting_escalated_job_says_so_in_its_reason() -> None:
    pending = [job("esc", at=NOW - 61, gpu_count=8, **ESC)]
    note = decide(pending, _one_free_gpu()).annotations["esc"]
    assert note.reason_pending.endswith("; escalated from spot to on-demand (§8.4)")


def test_an_escalated_job_gets_the_rights_of_its_target_class() -> None:
    """Escalated to reserved, it may preempt spot work (§8.2), which it could not as spot."""
    esc = {**ESC, "escalation_target_class": "reserved"}
    victim = running("victim", gpu_count=8, priority_class="spot", started=NOW - 3600)
    fleet = [worker("w1", jobs=[victim])]
    before = decide([job("esc", at=NOW - 30, gpu_count=8, **esc)], fleet)
    after = decide([job("esc", at=NOW - 3601, gpu_count=8, **esc)], fleet)
    assert before.preemptions == ()
    assert [(p.task_id, p.victims) for p in after.preemptions] == [("esc", ("victim",))]


def test_a_job_without_escalation_never_escalates() -> None:
    plain = job("p", at=0, gpu_count=1, priority_class="spot")
    assert escalated(plain, NOW + 10**6) is None
