"""A batch's run in the worker's main process (`worker.batch_runs`): each request the
head's pool job carries is started and ended as its own job, however the pool job ends.
Stand-ins for the gate's collaborators record what the runs asked of them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from billiard.exceptions import WorkerLostError

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.checkpoint.preempt import Preempted
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.batch import members_of
from celery_ojs_ml.worker.batch_runs import BatchRuns
from celery_ojs_ml.worker.running import Running

ALLOC = Allocation("head", "head", (2,), 1.0, 4.0, 0, "on-demand", False, 0.0)


class Req:
    """A Celery request as the runs use it: callbacks that record their calls."""

    def __init__(self, rid: str) -> None:
        self.id, self.name = rid, "infer"
        self.request_dict: dict[str, Any] = {"id": rid, "args": [rid], "kwargs": {}}
        self.calls: list[tuple[Any, ...]] = []
        self.is_revoked = False
        self.worker_pid: int | None = None

    def revoked(self) -> bool:
        return self.is_revoked

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        self.worker_pid = pid
        self.calls.append(("accepted", pid))

    def on_success(self, result: Any) -> None:
        self.calls.append(("success",))
        if result[0]:  # a failed run: Celery's on_success calls on_failure
            self.on_failure(result[1])

    def on_failure(self, exc_info: Any) -> None:
        self.calls.append(("failure", exc_info))

    def on_timeout(self, soft: bool, timeout: float) -> None:
        self.calls.append(("timeout", soft, timeout))


class Leases:
    def __init__(self, running: Running) -> None:
        self.running = running
        self.taken: list[tuple[str, tuple[int, ...]]] = []
        self.released: list[str] = []

    def take_lease(self, req: Any, alloc: Allocation) -> None:
        self.taken.append((req.id, alloc.devices))
        self.running.tokens[req] = f"token-{req.id}"

    def release_lease(self, task_id: str, token: str) -> None:
        self.released.append(task_id)

    def ack(self, req: Any) -> None:
        pass


class Preemptions:
    def __init__(self) -> None:
        self.victims: set[Any] = set()
        self.requeued: list[str] = []

    def yielded(self, req: Any, exc: BaseException) -> bool:
        return req in self.victims

    def requeue(self, req: Any, exc: BaseException) -> None:
        self.requeued.append(req.id)


def _runs(stale: tuple[str, ...] = ()) -> tuple[BatchRuns, Leases, Preemptions, Running]:
    running = Running()
    leases, preemptions = Leases(running), Preemptions()
    assignments = SimpleNamespace(may_start=lambda req, alloc: req.id not in stale)
    runs = BatchRuns(
        SimpleNamespace(event_dispatcher=None), "w@h", running, assignments,  # type: ignore[arg-type]
        leases, preemptions, lambda task_id: None, lambda req, why: None,  # type: ignore[arg-type]
    )  # fmt: skip
    return runs, leases, preemptions, running


def _batch(runs: BatchRuns, *ids: str) -> tuple[Req, list[Req]]:
    head, followers = Req("head"), [Req(i) for i in ids]
    runs.pending[head] = list(followers)
    runs.hand_over(head, ALLOC)
    return head, followers


def test_each_request_of_a_batch_gets_its_own_lease_without_devices() -> None:
    runs, leases, _, running = _runs()
    head, followers = _batch(runs, "f1", "f2")
    members, _ = members_of(head.request_dict[h.BATCH])
    assert [m["id"] for m in members] == ["f1", "f2"]
    assert leases.taken == [("f1", ()), ("f2", ())], "the head's lease holds the devices"
    assert all(running.requests[f.id] is f for f in followers)


def test_a_stale_or_revoked_request_is_not_carried() -> None:
    runs, leases, _, _ = _runs(stale=("f1",))
    revoked = Req("f3")
    revoked.is_revoked = True
    head = Req("head")
    runs.pending[head] = [Req("f1"), Req("f2"), revoked]
    runs.hand_over(head, ALLOC)
    members, _ = members_of(head.request_dict[h.BATCH])
    assert [m["id"] for m in members] == ["f2"] and leases.taken == [("f2", ())]


def test_the_requests_start_when_the_heads_pool_process_accepts_it() -> None:
    runs, _, _, _ = _runs()
    head, followers = _batch(runs, "f1")
    head.on_accepted(4242, 0.0)
    assert followers[0].calls == [("accepted", 4242)] and followers[0].worker_pid == 4242


def test_after_a_run_each_request_ends_once_and_its_lease_is_released() -> None:
    runs, leases, _, running = _runs()
    head, followers = _batch(runs, "f1", "f2")
    head.on_success((True, SimpleNamespace(exception=ValueError("body"))))  # -> on_failure too
    assert leases.released == ["f1", "f2"]
    assert all(f.calls == [] for f in followers), "the child stored their outcomes"
    assert running.requests == {} and running.tokens == {}
    assert "on_accepted" not in head.__dict__


def test_a_preempted_batch_re_publishes_every_request_as_a_preempted_job() -> None:
    runs, leases, preemptions, _ = _runs()
    head, _ = _batch(runs, "f1", "f2")
    preemptions.victims.add(head)
    head.on_failure(SimpleNamespace(exception=Preempted("head")))
    assert preemptions.requeued == ["f1", "f2"] and leases.released == ["f1", "f2"]


def test_a_lost_child_fails_each_request_as_celery_fails_the_head() -> None:
    runs, _, preemptions, _ = _runs()
    head, followers = _batch(runs, "f1")
    lost = SimpleNamespace(exception=WorkerLostError("SIGKILL"))
    head.on_failure(lost)
    assert followers[0].calls == [("failure", lost)] and preemptions.requeued == []


def test_a_hard_time_limit_times_out_each_request() -> None:
    runs, _, _, _ = _runs()
    head, followers = _batch(runs, "f1")
    head.on_timeout(True, 5.0)
    assert followers[0].calls == []
    head.on_timeout(False, 10.0)
    assert followers[0].calls == [("timeout", False, 10.0)]


def test_a_request_whose_lease_was_taken_over_ends_quietly() -> None:
    runs, leases, _, running = _runs()
    head, followers = _batch(runs, "f1", "f2")
    running.fenced.add(followers[0])  # as lease keeping fences a copy: no longer its token
    running.tokens.pop(followers[0])
    head.on_failure(SimpleNamespace(exception=WorkerLostError("killed")))
    assert followers[0].calls == [] and followers[1].calls != []
    assert leases.released == ["f2"], "the fenced copy's lease is not ours to release"
