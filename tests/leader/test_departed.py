"""The leader's memory of departed workers, which times the scheduler's RFC 27 DENY.

With `ojs_ml_deny_unsatisfiable`, a waiting job whose only capable workers left is
denied once they have been gone `ojs_ml_deny_after_s` (Flux RFC 27 "Alloc Deny":
the request "can never be fulfilled"); until then they count as away and the job
waits (OJS ML §7.2). Driven through the pure policy core, on an injected clock.
"""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.capabilities import capabilities_to_dict
from celery_ojs_ml.leader.departed import Departed
from celery_ojs_ml.scheduler import Decision, Denial, Policy, WorkerState, schedule
from tests.scheduler.helpers import caps, job, running, worker

T0 = 1_000.0
AFTER_S = 2.0


def entry(name: str, profile: str, queues: tuple[str, ...] = ("celery",)) -> dict[str, Any]:
    """A live worker's registry entry, as the leader reads it."""
    return {"capabilities": capabilities_to_dict(caps(profile, name)), "info": {"queues": queues}}


LIVE = {"a100": entry("a100", "nvidia-a100x2"), "l4": entry("l4", "nvidia-l4x1")}
WITHOUT_L4 = {"a100": LIVE["a100"]}
L4_JOB = job("j", gpu_count=1, gpu_type="nvidia-l4")


def a_pass(departed: Departed, live: dict[str, Any], now: float) -> Decision:
    """One pass, as the leader runs it, over the live workers plus the away ones. The L4
    worker, while live, is busy (its GPU held), so the L4 job waits for it."""
    away = departed.observe(live, now)
    fleet: list[WorkerState] = [worker("a100", "nvidia-a100x2")]
    if "l4" in live:
        fleet.append(worker("l4", "nvidia-l4x1", [running("r", gpu_count=1)]))
    return schedule([L4_JOB], [*fleet, *away], now, departed.policy(Policy(), now))


def test_a_job_whose_only_capable_worker_left_waits_for_it_then_is_denied() -> None:
    """RFC 27 DENY after `ojs_ml_deny_after_s`, with the note the job fails with."""
    departed = Departed(True, AFTER_S)
    a_pass(departed, LIVE, T0)
    a_pass(departed, LIVE, T0 + AFTER_S)  # this leadership has observed long enough
    left = a_pass(departed, WITHOUT_L4, T0 + AFTER_S + 0.5)
    still = a_pass(departed, WITHOUT_L4, T0 + 2 * AFTER_S + 0.4)
    gone = a_pass(departed, WITHOUT_L4, T0 + 2 * AFTER_S + 0.5)
    assert left.denials == still.denials == ()
    assert left.annotations["j"].reason_pending == (
        "1/2 workers eligible: 1 gpu_type nvidia-a100 not in [nvidia-l4], 1 worker away"
    )
    [denial] = gone.denials
    assert departed.note(denial) == (
        "RFC 27 DENY: no worker that can run it has been live for 2 s (ojs_ml_deny_after_s): "
        "0/1 workers eligible: 1 gpu_type nvidia-a100 not in [nvidia-l4]"
    )


def test_a_worker_back_within_the_time_saves_the_job() -> None:
    departed = Departed(True, AFTER_S)
    a_pass(departed, LIVE, T0)
    a_pass(departed, WITHOUT_L4, T0 + AFTER_S)
    assert departed.observe(LIVE, T0 + AFTER_S + 1) == []  # back: live, not away
    later = a_pass(departed, WITHOUT_L4, T0 + 2 * AFTER_S + 1.5)  # left again 0.5 s ago
    assert later.denials == ()
    assert "1 worker away" in later.annotations["j"].reason_pending


def test_a_new_leadership_denies_nothing_before_it_has_observed_the_time() -> None:
    """A new leader never saw the workers that left before it: it waits `deny_after_s`."""
    departed = Departed(True, AFTER_S)
    first = a_pass(departed, WITHOUT_L4, T0)
    early = a_pass(departed, WITHOUT_L4, T0 + AFTER_S - 0.1)
    ready = a_pass(departed, WITHOUT_L4, T0 + AFTER_S)
    assert first.denials == early.denials == ()
    assert [d.task_id for d in ready.denials] == ["j"]
    departed.hello()
    assert a_pass(departed, WITHOUT_L4, T0 + 10 * AFTER_S).denials == ()


def test_without_deny_unsatisfiable_nothing_is_remembered_and_the_job_waits() -> None:
    """OJS ML §7.2: the job remains waiting until a matching worker becomes available."""
    departed = Departed(False, AFTER_S)
    a_pass(departed, LIVE, T0)
    later = a_pass(departed, WITHOUT_L4, T0 + 100 * AFTER_S)
    assert later.denials == ()
    assert later.annotations["j"].reason_pending == (
        "0/1 workers eligible: 1 gpu_type nvidia-a100 not in [nvidia-l4]"
    )


def test_a_departed_worker_keeps_its_queues_and_a_reservation_denial_keeps_its_note() -> None:
    departed = Departed(True, AFTER_S)
    departed.observe({"l4": entry("l4", "nvidia-l4x1", ("train",))}, T0)
    [away] = departed.observe({}, T0 + 1)
    assert (away.name, away.available, away.queues) == ("l4", False, frozenset({"train"}))
    assert departed.note(Denial("k", "reservation 'r1' ended")) == "reservation 'r1' ended"
