"""`judge`: the demo's verdict on what it saw, one sentence per problem."""

from __future__ import annotations

import pytest

from celery_ojs_ml.demo.jobs import DemoJob
from celery_ojs_ml.demo.watch import BLOCKED, DONE, QUEUED, WAITING, Row, judge, settled

A100 = frozenset({"a100@demo"})


def job(label: str, eligible: frozenset[str] = A100, after: str | None = None) -> DemoJob:
    return DemoJob(label, label, "ml.train", "on-demand", eligible, after=after)


def ran(j: DemoJob, node: str, devices: tuple[int, ...], start: float, end: float) -> Row:
    return Row(j, DONE, node=node, devices=devices, started=start, finished=end)


FIRST, SECOND = job("step1"), job("step2", after="step1")
IMPOSSIBLE = job("zz", frozenset())

CASES: dict[str, tuple[list[Row], list[str]]] = {
    "a clean outcome has no problems": (
        [
            ran(FIRST, "a100@demo", (0, 1), 0.0, 1.0),
            ran(SECOND, "a100@demo", (0, 1), 1.0, 2.0),
            Row(IMPOSSIBLE, WAITING, reason="0/3 workers eligible: ..."),
        ],
        [],
    ),
    "a job on a node that cannot run it is a wrong placement": (
        [ran(FIRST, "l4@demo", (0,), 0.0, 1.0)],
        ["step1 ran on l4@demo, which cannot run it (eligible: a100@demo)"],
    ),
    "a runnable job still queued did not finish": (
        [Row(FIRST, QUEUED)],
        ["step1 (step1) did not finish; it is queued"],
    ),
    "a chain step that started before its predecessor finished is out of order": (
        [ran(FIRST, "a100@demo", (0,), 0.0, 2.0), ran(SECOND, "a100@demo", (1,), 1.0, 3.0)],
        ["step2 started before step1 finished"],
    ),
    "two jobs on the same GPU at the same time break capacity safety": (
        [
            ran(job("x"), "a100@demo", (0, 1), 0.0, 2.0),
            ran(job("y"), "a100@demo", (1, 2), 1.0, 3.0),
        ],
        ["x and y both ran on a100@demo GPU(s) [1] at the same time"],
    ),
    "an impossible job without a pending reason is a problem": (
        [Row(IMPOSSIBLE, WAITING, reason="")],
        ["zz (zz) no node can run it, yet it is waiting"],
    ),
    "an impossible job that ran is a problem": (
        [ran(IMPOSSIBLE, "a100@demo", (), 0.0, 1.0)],
        ["zz (zz) no node can run it, yet it is done"],
    ),
}


@pytest.mark.parametrize("rows,problems", list(CASES.values()), ids=list(CASES))
def test_judge(rows: list[Row], problems: list[str]) -> None:
    assert judge(rows) == problems


def test_the_demo_settles_once_runnable_jobs_finished_and_impossible_ones_wait() -> None:
    waiting = Row(IMPOSSIBLE, WAITING, reason="r")
    assert settled([ran(FIRST, "a100@demo", (), 0, 1), waiting])
    assert not settled([ran(FIRST, "a100@demo", (), 0, 1), Row(SECOND, BLOCKED), waiting])
    assert not settled([Row(FIRST, WAITING, reason="no live worker yet")])
