"""Fencing a copy whose pool child has not yet reported that it started (DESIGN invariant 5)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from celery_ojs_ml.integration.lease_keeping import LeaseKeeping


class _Timer:
    def __init__(self) -> None:
        self.due: list[tuple[Any, tuple[Any, ...]]] = []

    def call_after(self, _secs: float, fun: Any, args: tuple[Any, ...] = ()) -> None:
        self.due.append((fun, args))

    def run(self) -> None:
        due, self.due = self.due, []
        for fun, args in due:
            fun(*args)


class _Keeper(LeaseKeeping):
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.fenced = set()
        self.stopping = set()
        self.prefork = True
        self.killed: list[int | None] = []
        self.c = SimpleNamespace(timer=_Timer())

    def kill_child(self, pid: int | None) -> bool:
        self.killed.append(pid)
        return True


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
