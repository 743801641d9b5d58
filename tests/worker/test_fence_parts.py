"""Fencing a copy whose pool child has not yet reported that it started (DESIGN invariant 5)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_ojs_ml.worker.lease_keeping import LeaseKeeper
from celery_ojs_ml.worker.running import Running
from celery_ojs_ml.worker.stopping import ChildStopper


class _Timer:
    def __init__(self) -> None:
        self.due: list[tuple[Any, tuple[Any, ...]]] = []

    def call_after(self, _secs: float, fun: Any, args: tuple[Any, ...] = ()) -> None:
        self.due.append((fun, args))

    def run(self) -> None:
        due, self.due = self.due, []
        for fun, args in due:
            fun(*args)


class _Leases:
    """The lease book as `_lease_missing` sees it: the marks of copies taken back."""

    def __init__(self, taken_back: set[tuple[str, str]]) -> None:
        self.taken_back = taken_back
        self.rewritten: list[tuple[str, str | None]] = []

    def was_taken_back(self, task_id: str, token: str) -> bool:
        return (task_id, token) in self.taken_back

    def take(self, record: dict[str, Any], token: str | None = None) -> str:
        self.rewritten.append((record["task_id"], token))
        return token or "new"


class _Stopper(ChildStopper):
    """Kills nothing: records the pids it would kill."""

    def __init__(self, consumer: Any, running: Running, killed: list[int | None]) -> None:
        super().__init__(consumer, True, running)
        self.killed = killed

    def kill_child(self, pid: int | None) -> bool:
        self.killed.append(pid)
        return True


class _Keeper(LeaseKeeper):
    def __init__(self) -> None:
        running = Running()
        self.killed: list[int | None] = []
        self.c = SimpleNamespace(timer=_Timer())
        self.allocations: list[Any] = []
        allocator: Any = SimpleNamespace(allocations=lambda: self.allocations)
        stopper = _Stopper(self.c, running, self.killed)
        none: Any = None
        super().__init__(none, none, allocator, running, none, stopper, "w", "inc")
        self.leases = _Leases(set())  # type: ignore[assignment]
        self.store = SimpleNamespace(_clock=lambda: 1000.0)  # type: ignore[assignment]

    def _already_finished(self, task_id: str) -> bool:
        return False

    def _job_record(self, req: Any, alloc: Any, started_at: float) -> dict[str, Any]:
        return {"task_id": req.id}


class _Request:
    """A request as the fence sees it (hashable by identity, as Celery's are)."""

    def __init__(self, task_id: str, pid: int | None) -> None:
        self.id, self.name, self.worker_pid = task_id, "ml.record", pid


def _req(task_id: str, pid: int | None) -> Any:
    return _Request(task_id, pid)


def test_a_fenced_copy_is_killed_once_its_child_reports_its_pid() -> None:
    """The worker stalled between writing the lease and reading the child's "started":
    the fence comes before the pid is known, and the kill waits for it."""
    keeper, req = _Keeper(), _req("t1", None)
    keeper.tokens = {req: "tok"}
    keeper.fence({"t1"})
    assert keeper.killed == [] and req in keeper.fenced
    keeper.c.timer.run()  # still no pid: asks again
    assert keeper.killed == [] and keeper.c.timer.due
    req.worker_pid = 4242
    keeper.c.timer.run()
    assert keeper.killed == [4242]
    assert "t1" not in {r.id for r in keeper.tokens}


def test_a_fenced_copy_that_ended_meanwhile_is_not_waited_for() -> None:
    keeper, req = _Keeper(), _req("t2", None)
    keeper.tokens = {req: "tok"}
    keeper.fence({"t2"})
    keeper.fenced.discard(req)  # its failure path ran
    req.worker_pid = 99
    keeper.c.timer.run()
    assert keeper.killed == [] and not keeper.c.timer.due


def test_a_fenced_copy_with_a_known_pid_is_killed_at_once() -> None:
    keeper, req = _Keeper(), _req("t3", 7)
    keeper.tokens = {req: "tok"}
    keeper.fence({"t3"})
    assert keeper.killed == [7] and not keeper.c.timer.due


def test_a_copy_whose_missing_lease_a_claimer_took_back_is_fenced_not_written_again() -> None:
    """DESIGN invariant 5. The worker stalled past the TTL; a claimer re-published the job
    and deleted the lease. Found missing, the lease is not taken for one the store lost:
    this copy is stopped. A lease the store lost (no mark) is written again."""
    keeper = _Keeper()
    stale, lost = _req("t4", 11), _req("t5", 12)
    keeper.tokens = {stale: "old", lost: "mine"}
    keeper.leases = _Leases({("t4", "old")})
    keeper.allocations = [SimpleNamespace(key=stale), SimpleNamespace(key=lost)]
    keeper._lease_missing({"t4", "t5"})
    assert keeper.killed == [11] and stale in keeper.fenced
    assert keeper.leases.rewritten == [("t5", "mine")], "only the lost lease is written again"
    assert lost in keeper.tokens and lost not in keeper.fenced


def test_an_older_copy_of_a_job_that_started_here_again_is_stale() -> None:
    """A job is re-published only once taken from its copy, so when a newer copy of it
    starts on the same worker the older one is stopped, and only the newer one's lease
    is refreshed."""
    keeper = _Keeper()
    old, new, other = _req("t6", 21), _req("t6", 22), _req("t7", 23)
    keeper.tokens = {old: "a", other: "c", new: "b"}
    mine, older = keeper._held_leases()
    assert mine == {"t6": "b", "t7": "c"} and older == [old]
