"""The leader's prefetch rules (`leader.prefetch`), on its pure inputs: which
jobs go ahead to a gate, and which held ones are taken back. The same rules on real
workers are in test_prefetch.py."""

from __future__ import annotations

from typing import Any


def _leader(sent: list[str], delivered: bool = False) -> Any:
    """A maker of `Prefetch` (prefetch 2) that records what it would deliver in `sent`;
    the delivery reports success only with `delivered`."""
    from types import SimpleNamespace

    from celery_ojs_ml.leader.budget_holds import BudgetHolds
    from celery_ojs_ml.leader.fleet_view import pending_job
    from celery_ojs_ml.leader.notes import Notes
    from celery_ojs_ml.leader.prefetch import Prefetch
    from celery_ojs_ml.scheduler import Policy

    def deliver(state: Any, task_id: str, *args: Any, **kwargs: Any) -> bool:
        sent.append(task_id)
        return delivered

    def make() -> Any:
        # planned starts up to 15 s away count as soon (half of max_hold_s)
        settings = SimpleNamespace(prefetch=2, max_hold_s=30.0)
        policy = Policy()
        leader: Any = Prefetch(
            settings, policy, None, deliver, BudgetHolds(policy), Notes(None),  # type: ignore[arg-type]
            lambda headers: None, lambda t, r: pending_job(t, r, leader.parse),
        )  # fmt: skip
        return leader

    return make


def _send(leader: Any, decision: Any, fleet: Any, records: Any, jobs: Any, now: float) -> None:
    """One pass's `Prefetch.send_ahead` over these values."""
    from celery_ojs_ml.leader.pass_state import PassState

    state = PassState(now, records=records, fleet=fleet, jobs=jobs, decision=decision)
    leader.send_ahead(state)


def _unhold(leader: Any, decision: Any, fleet: Any, records: Any, jobs: Any) -> None:
    """One pass's `Prefetch.unhold` over these values."""
    from celery_ojs_ml.leader.pass_state import PassState

    leader.unhold(PassState(0.0, records=records, fleet=fleet, jobs=jobs, decision=decision))


def _full(name: str, gpus: int = 1, each: int = 1) -> Any:
    """A worker whose every GPU is held by running spot-band jobs of `each` GPUs."""
    from celery_ojs_ml.scheduler import RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.testing.builders import worker_with

    running = [
        RunningJob(f"{name}-run{i}", "on-demand", started_at=90.0, gpus=each)
        for i in range(gpus // each)
    ]
    return WorkerState.of(name, worker_with(gpus=gpus), running)


def test_a_job_sitting_out_a_give_back_is_not_prefetched_back_at_once() -> None:
    """A reserved job in its give-back back-off keeps its reservation (and its place), but
    is not delivered ahead to the worker: the back-off exists so a job a gate disagrees
    on does not bounce back there on every pass."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    sent: list[str] = []
    Leader = _leader(sent)

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {
        "fresh": PendingJob("fresh", req, submitted_at=1.0),
        "returned": PendingJob("returned", req, submitted_at=2.0, not_before=105.0),
    }
    decision = Decision(
        reservations=(Reservation("fresh", "w", 110.0), Reservation("returned", "w", 110.0))
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    fleet = [_full("w")]
    _send(Leader(), decision, fleet, records, jobs, 100.0)
    assert sent == ["fresh"]
    sent.clear()
    _send(Leader(), decision, fleet, records, jobs, 106.0)
    assert sent == ["fresh", "returned"], "sent ahead once its back-off is over"


def test_a_job_ranked_above_a_preemptible_job_on_its_worker_is_not_prefetched() -> None:
    """It may preempt there once the victim is old enough, which only a pass plans; a job
    after it in order is not sent ahead either (the gate would start it first, if the
    victim ended), and a job of the running one's band (it cannot preempt it) reserved
    there with nothing ahead of it is still sent ahead."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation, RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    Leader = _leader(sent)

    spot = RunningJob("victim", "spot", started_at=90.0, gpus=1, preemptible=True)
    fleet = [WorkerState.of("w", worker_with(gpus=1), [spot])]
    jobs = {
        "urgent": PendingJob("urgent", normalize({"ext_ml_gpu_count": 1,
                             "ext_ml_priority_class": "reserved"}).requirements),
        "cheap": PendingJob("cheap", normalize({"ext_ml_gpu_count": 1,
                            "ext_ml_priority_class": "spot"}).requirements),
    }  # fmt: skip
    decision = Decision(
        reservations=(Reservation("urgent", "w", 110.0), Reservation("cheap", "w", 110.0))
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    _send(Leader(), decision, fleet, records, jobs, 100.0)
    assert sent == [], "a job was sent ahead of one before it in order on its worker"
    alone = Decision(reservations=(Reservation("cheap", "w", 110.0),))
    _send(Leader(), alone, fleet, records, jobs, 100.0)
    assert sent == ["cheap"]


def test_once_a_reserved_job_is_not_sent_ahead_no_later_job_is_sent_to_that_worker() -> None:
    """Fleet order at the gate (docs/scheduling.md, order rule 1): a gang rank reserved on
    `w` cannot be prefetched, so the 1-GPU job after it is not sent there either (the gate
    would start it first and delay the gang); another worker's reservations still are."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    sent: list[str] = []
    Leader = _leader(sent)
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {
        "rank0": PendingJob("rank0", req, submitted_at=1.0, gang="g", gang_size=2, rank=0),
        "small": PendingJob("small", req, submitted_at=2.0),
        "other": PendingJob("other", req, submitted_at=3.0),
    }
    decision = Decision(
        reservations=(
            Reservation("rank0", "w", 110.0),
            Reservation("small", "w", 110.0),
            Reservation("other", "v", 110.0),
        )
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    _send(Leader(), decision, [_full("w"), _full("v")], records, jobs, 100.0)
    assert sent == ["other"]


def test_only_a_job_that_starts_at_the_first_end_on_a_full_worker_is_sent_ahead() -> None:
    """Held at the gate, a job that waits through several ends would keep shorter jobs off
    the GPUs freed meanwhile (the gate's backfill rule knows no time limits), and on a
    worker with a free GPU it would keep the backfill the pass allows off that GPU."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    Leader = _leader(sent)
    one = normalize({"ext_ml_gpu_count": 1}).requirements
    two = normalize({"ext_ml_gpu_count": 2}).requirements
    jobs = {"two": PendingJob("two", two, submitted_at=1.0), "one": PendingJob("one", one)}
    plan = Decision(reservations=(Reservation("two", "w", 110.0), Reservation("one", "w", 111)))
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    _send(Leader(), plan, [_full("w", gpus=4, each=1)], records, jobs, 100.0)
    assert sent == [], "a 2-GPU job sent ahead where each end frees 1 GPU (and one after it)"
    _send(Leader(), plan, [_full("w", gpus=4, each=2)], records, jobs, 100.0)
    assert sent == ["two", "one"]
    sent.clear()
    half = WorkerState.of("w", worker_with(gpus=4), list(_full("w", 2).running))
    _send(Leader(), plan, [half], records, jobs, 100.0)
    assert sent == [], "sent ahead to a worker with free GPUs"


def test_a_job_of_a_queue_with_a_gpu_budget_is_not_sent_ahead_and_other_queues_still_are() -> None:
    """§10.3: an assigned job holds its queue's budget, so one waiting at a gate would use
    it up while it waits; a job of another queue on the next worker still goes ahead."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, Reservation
    from celery_ojs_ml.scheduler.budget import Budget
    from celery_ojs_ml.spec.normalize import normalize

    sent: list[str] = []
    leader = _leader(sent)()
    leader.policy = Policy(budgets=(("capped", Budget(max_total_gpus=8)),))
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {
        "capped": PendingJob("capped", req, submitted_at=1.0, queue="capped"),
        "free": PendingJob("free", req, submitted_at=2.0, queue="celery"),
    }
    plan = Decision(
        reservations=(Reservation("capped", "w", 110.0), Reservation("free", "v", 110.0))
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    _send(leader, plan, [_full("w"), _full("v")], records, jobs, 100.0)
    assert sent == ["free"]


def test_a_prefetched_job_is_taken_back_when_a_job_ahead_of_it_in_order_waits_for_its_worker() -> (
    None
):
    """A spot job waits at `w`'s gate; a reserved-band job published after it is reserved on
    `w`. The gate would start the spot job first, so the leader takes it back (fenced by
    its token); a prefetched job with nothing ahead of it on its worker stays."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    taken: list[tuple[str, str, str]] = []

    class Book:
        def take_back(self, task_id: str, token: str, why: str, cool: bool = True) -> bool:
            taken.append((task_id, token, why))
            return True

    leader = _leader([])()
    leader.book = Book()  # type: ignore[attr-defined]
    leader.parse = lambda headers: req  # type: ignore[attr-defined]

    def held(band: str, at: float, worker: str) -> dict[str, Any]:
        meta = {"band": band, "submitted_at": at, "queue": "celery"}
        return {"state": "assigned", "worker": worker, "token": "t1", "meta": meta,
                "msg": {"headers": {}}}  # fmt: skip

    records = {"spot": held("spot", 1.0, "w"), "calm": held("spot", 1.5, "v")}
    leader.sent = {"spot": "w", "calm": "v"}
    urgent = PendingJob("urgent", req, submitted_at=5.0, band="reserved")
    later = PendingJob("later", req, submitted_at=6.0, band="spot")
    decision = Decision(
        reservations=(Reservation("urgent", "w", 110.0), Reservation("later", "v", 110.0))
    )
    _unhold(leader, decision, [], records, {"urgent": urgent, "later": later})
    assert [t[0] for t in taken] == ["spot"], taken
    assert taken[0][1] == "t1" and "urgent, ahead of it in fleet order" in taken[0][2]
    assert leader.sent == {"calm": "v"}


def test_an_escalated_job_is_not_sent_ahead_and_the_jobs_it_now_outranks_are_taken_back() -> None:
    """OJS ML §8.4: escalation changes only the band a pass sees; the job's message keeps
    its old band, which the gate orders held jobs by. So it is not sent ahead (nor is a
    job after it, to that worker), and an on-demand job already held at that gate, which
    it now outranks, is taken back."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    spot = normalize(
        {"ext_ml_gpu_count": 1, "ext_ml_priority_class": "spot",
         "ext_ml_priority_escalation": True, "ext_ml_escalation_target_class": "reserved"}
    ).requirements  # fmt: skip
    plain = normalize({"ext_ml_gpu_count": 1}).requirements
    sent: list[str] = []
    taken: list[str] = []

    class Book:
        def take_back(self, task_id: str, token: str, why: str, cool: bool = True) -> bool:
            taken.append(task_id)
            return True

        def annotate(self, notes: Any, ahead: bool = False) -> None:
            pass

    leader = _leader(sent)()
    leader.book = Book()  # type: ignore[attr-defined]
    leader.parse = lambda headers: plain  # type: ignore[attr-defined]
    meta = {"band": "on-demand", "submitted_at": 0.5, "queue": "celery"}
    records: dict[str, dict[str, Any]] = {
        "held": {"state": "assigned", "worker": "w", "token": "t", "meta": meta,
                 "msg": {"headers": {}}},
        "esc": {"state": "pending"},
        "next": {"state": "pending"},
    }  # fmt: skip
    leader.sent = {"held": "w"}
    jobs = {
        "esc": PendingJob("esc", spot, submitted_at=1.0, band="spot"),
        "next": PendingJob("next", plain, submitted_at=2.0, band="on-demand"),
    }
    decision = Decision(
        reservations=(Reservation("esc", "w", 110.0), Reservation("next", "w", 111.0)),
        escalations={"esc": "spot"},
    )
    fleet = [_full("w")]
    _unhold(leader, decision, fleet, records, jobs)
    assert taken == ["held"], "the held on-demand job would start before the escalated job"
    _send(leader, decision, fleet, records, jobs, 100.0)
    assert sent == [], sent


def test_a_job_goes_ahead_only_where_it_is_likely_to_start_before_the_gate_gives_it_back() -> None:
    """Jobs without time limits (no planned start) go ahead only to a worker where a pass
    saw a running job end within half of `ojs_ml_max_hold_s`; a planned start further
    away than that is not sent ahead. Elsewhere the gate would give the job back after
    `ojs_ml_max_hold_s` and it would be sent again, over and over."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    leader = _leader(sent)()
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {"j": PendingJob("j", req)}
    records: dict[str, dict[str, Any]] = {"j": {"state": "pending"}}
    unknown = Decision(reservations=(Reservation("j", "w", None),))
    first = _full("w", gpus=2)
    _send(leader, unknown, [first], records, jobs, 100.0)
    assert sent == [], "sent ahead with no end seen and no planned start"
    one_ended = WorkerState.of(
        "w", worker_with(gpus=2), [*first.running[1:], _full("x").running[0]]
    )
    _send(leader, unknown, [one_ended], records, jobs, 101.0)
    assert sent == ["j"], "a job ended there a second ago"
    sent.clear()
    _send(leader, unknown, [one_ended], records, jobs, 140.0)
    assert sent == [], "no end seen for 39 s (horizon 15 s)"
    far = Decision(reservations=(Reservation("j", "w", 160.0),))
    _send(leader, far, [one_ended], records, jobs, 140.0)
    assert sent == [], "planned start 20 s away"
    near = Decision(reservations=(Reservation("j", "w", 150.0),))
    _send(leader, near, [one_ended], records, jobs, 140.0)
    assert sent == ["j"]


def test_the_jobs_held_ahead_at_a_gate_start_in_order_as_the_running_jobs_end() -> None:
    """The i-th job held ahead starts when the i-th running job ends (by its time limit);
    a job past its limit ends a second from now (`Policy.overdue_s`), one without a limit
    frees nothing known, and a ledger entry of a job delivered ahead is not running."""
    from celery_ojs_ml.leader.prefetch import ahead_estimates
    from celery_ojs_ml.scheduler import RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.testing.builders import worker_with

    running = [
        RunningJob("late", "spot", started_at=60.0, gpus=1, time_limit_s=30.0),  # ended at 90
        RunningJob("long", "spot", started_at=90.0, gpus=1, time_limit_s=30.0),  # ends 120
        RunningJob("open", "spot", started_at=90.0, gpus=1),  # no limit
        RunningJob("sent", "spot", started_at=99.0, gpus=1, time_limit_s=5.0),  # held ahead
    ]
    state = WorkerState.of("w", worker_with(gpus=4), running)
    got = ahead_estimates(state, ["a", "b", "c"], {"sent", "a", "b", "c"}, 100.0, 1.0)
    assert got == {"a": 101.0, "b": 120.0, "c": None}


def test_a_later_pass_moves_the_estimate_of_a_job_held_ahead_when_a_job_ends_early() -> None:
    """Two jobs run on `w` (limits end at 110 and 120); `first` and `second` were sent
    ahead with those estimates. The 120 one ends early and `first` starts in its place:
    `second` now waits for the job ending at 110, and the next pass writes that estimate
    (with the reason it was sent with), once; an estimate that did not move is not
    written again."""
    from celery_ojs_ml.scheduler import Decision, Policy, RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    written: list[dict[str, Any]] = []

    class Book:
        def annotate(self, notes: dict[str, Any], *, ahead: bool = False) -> None:
            assert ahead
            written.append(dict(notes))

    leader = _leader([])()
    leader.book = Book()  # type: ignore[attr-defined]
    leader.parse = lambda headers: req  # type: ignore[attr-defined]
    leader.policy = Policy()
    meta = {"band": "spot", "submitted_at": 1.0, "queue": "celery"}
    records = {
        "first": {"state": "started", "worker": "w", "meta": meta, "msg": {"headers": {}}},
        "second": {
            "state": "assigned",
            "worker": "w",
            "meta": {**meta, "submitted_at": 2.0},
            "msg": {"headers": {}},
        },
    }
    leader.sent = {"first": "w", "second": "w"}
    leader.ahead_notes = {"first": ("busy; ahead", 110.0, "w")}
    leader.ahead_notes["second"] = ("busy; ahead", 120.0, "w")
    running = [
        RunningJob("r110", "spot", started_at=80.0, gpus=1, time_limit_s=30.0),
        RunningJob("first", "spot", started_at=105.0, gpus=1),
        RunningJob("second", "spot", started_at=100.0, gpus=1, time_limit_s=60.0),  # ledger
    ]
    fleet = [WorkerState.of("w", worker_with(gpus=2), running)]
    _send(leader, Decision(), fleet, records, {}, 105.0)
    assert written == [{"second": ("busy; ahead", 110.0, "w")}]
    assert leader.sent == {"second": "w"}
    _send(leader, Decision(), fleet, records, {}, 106.0)
    assert written == [{"second": ("busy; ahead", 110.0, "w")}], "written once"


def test_a_job_sent_ahead_behind_another_gets_the_gates_estimate_in_the_pass_that_sends_it() -> (
    None
):
    """`first` waits ahead at `w` for the end at 110. The core plans `second` on `w` at 110
    too, as if `first` ran already; at the gate it starts at the next end (120), and that
    is the estimate written when it is sent (not one pass later)."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation, RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    written: list[dict[str, Any]] = []

    class Book:
        def annotate(self, notes: dict[str, Any], *, ahead: bool = False) -> None:
            written.append(dict(notes))

    leader = _leader([], delivered=True)()
    leader.book = Book()
    leader.parse = lambda headers: req
    meta = {"band": "on-demand", "submitted_at": 1.0, "queue": "celery"}
    records = {
        "first": {"state": "assigned", "worker": "w", "meta": meta, "msg": {"headers": {}}},
        "second": {"state": "pending", "meta": {**meta, "submitted_at": 2.0}, "msg": {}},
    }
    leader.sent = {"first": "w"}
    leader.ahead_notes = {"first": ("busy; ahead", 110.0, "w")}
    running = [
        RunningJob("r110", "spot", started_at=80.0, gpus=1, time_limit_s=30.0),
        RunningJob("r120", "spot", started_at=90.0, gpus=1, time_limit_s=30.0),
        RunningJob("first", "on-demand", started_at=100.0, gpus=1),  # its ledger entry
    ]
    fleet = [WorkerState.of("w", worker_with(gpus=2), running)]
    jobs = {"second": PendingJob("second", req, band="on-demand", submitted_at=2.0)}
    plan = Decision(reservations=(Reservation("second", "w", 110.0),))
    _send(leader, plan, fleet, records, jobs, 105.0)
    assert leader.sent == {"first": "w", "second": "w"}
    assert [{k: v[1] for k, v in notes.items()} for notes in written] == [{"second": 120.0}]


def test_a_held_job_is_not_taken_back_for_a_worker_whose_processes_are_all_busy() -> None:
    """`spot` waits at `w`'s gate. `v` has a free GPU: with a free pool process it can
    start the job now and the leader takes it back from `w`; with every process busy
    the job would only wait in `v`'s pool queue, so it stays at `w`."""
    from celery_ojs_ml.scheduler import Decision, RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    taken: list[str] = []

    class Book:
        def take_back(self, task_id: str, token: str, why: str, cool: bool = True) -> bool:
            taken.append(task_id)
            return True

    meta = {"band": "spot", "submitted_at": 1.0, "queue": "celery"}
    records = {"spot": {"state": "assigned", "worker": "w", "token": "t1", "meta": meta,
                        "msg": {"headers": {}}}}  # fmt: skip
    busy = [RunningJob("r", "spot", started_at=90.0, gpus=1)]
    for processes, expected in ((2, ["spot"]), (1, [])):
        taken.clear()
        leader = _leader([])()
        leader.book = Book()  # type: ignore[attr-defined]
        leader.parse = lambda headers: req  # type: ignore[attr-defined]
        leader.sent = {"spot": "w"}
        fleet = [
            WorkerState.of("w", worker_with(gpus=1), busy),
            WorkerState.of("v", worker_with(gpus=2), busy, processes=processes),
        ]
        _unhold(leader, Decision(), fleet, records, {})
        assert taken == expected, processes
