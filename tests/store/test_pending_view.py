"""PendingView on a real Redis: the leader's pending set, read whole once, then only changes.

Whatever happened in between, a pass must see exactly what a full read sees
(`PendingBook.records(lean=True)`); and it must read only what changed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from celery_ojs_ml.leader.pending_view import FULL_EVERY_S, PendingView
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _msg(task_id: str) -> dict[str, Any]:
    return {"body": f"payload-of-{task_id}", "headers": {"id": task_id, "task": "t"}}


def _admit(book: PendingBook, task_id: str, at: float) -> None:
    assert book.admit(task_id, {"submitted_at": at, "queue": "ml"}, _msg(task_id))


@pytest.fixture
def book(store: OJSStore) -> PendingBook:
    return PendingBook(store)


def _same(view: PendingView, book: PendingBook) -> None:
    seen = view.records()
    full = book.records(lean=True)
    assert list(seen) == list(full), "membership and admission order"
    for task_id, record in full.items():
        assert seen[task_id] == record, task_id


def test_a_pass_reads_only_the_records_that_changed_since_the_last(book: PendingBook) -> None:
    clock = Clock()
    view = PendingView(book, clock)
    for n in range(5):
        _admit(book, f"j{n}", float(n))
    assert list(view.records()) == ["j0", "j1", "j2", "j3", "j4"]
    assert view.reads == 5, "the first pass reads everything"
    view.records()
    assert view.reads == 5, "nothing changed: nothing read"
    token = book.assign("j1", "w@h", now=1.0)
    assert token is not None
    assert view.records()["j1"]["state"] == "assigned"
    assert view.reads == 6
    assert book.give_back("j1", token, "no room")  # what a gate does
    assert view.records()["j1"]["reason"] == "no room"
    assert view.reads == 7
    assert book.prioritize("j3", 7)
    assert view.records()["j3"]["priority"] == "7"
    token = book.assign("j0", "w@h", now=2.0)
    assert token is not None and book.start("j0", token, "w@h") == "ok"
    assert "j0" not in view.records(), "a started job leaves the view"
    clock.now += FULL_EVERY_S
    before = view.reads
    view.records()
    assert view.reads - before == 4, "a full read every FULL_EVERY_S"


def test_a_job_put_back_with_its_redelivered_message_reappears(book: PendingBook) -> None:
    view = PendingView(book, Clock())
    _admit(book, "j", 1.0)
    token = book.assign("j", "w@h", now=1.0)
    assert token is not None
    assert view.records()["j"]["state"] == "assigned"
    assert book.start("j", token, "w@h") == "ok"
    assert book.give_back("j", token, "no room", msg=_msg("j"))
    assert view.records()["j"]["state"] == "pending"


def test_the_leaders_own_admissions_reach_its_view_without_a_read(book: PendingBook) -> None:
    view = PendingView(book, Clock())
    book.on_admit = view.put  # as `FleetScheduler` wires it
    assert view.records() == {}  # a new leader's first pass reads everything
    for n in range(3):
        _admit(book, f"j{n}", float(n))
    assert list(view.records()) == ["j0", "j1", "j2"]
    assert view.reads == 0
    _same(view, book)


@pytest.mark.parametrize("wired", [True, False])
def test_the_view_equals_a_full_read_after_any_sequence_of_changes(
    book: PendingBook, wired: bool
) -> None:
    rng = random.Random(7)
    view = PendingView(book, Clock())
    if wired:
        book.on_admit = view.put
    tokens: dict[str, str] = {}
    for step in range(300):
        task_id = f"j{rng.randrange(12)}"
        op = rng.choice(["admit", "assign", "give", "start", "cancel", "prio", "hold", "again"])
        if op == "admit":
            book.admit(task_id, {"submitted_at": float(step), "queue": "ml"}, _msg(task_id))
        elif op == "assign" and (token := book.assign(task_id, "w@h", now=float(step))):
            tokens[task_id] = token
        elif op == "give" and task_id in tokens:
            book.give_back(task_id, tokens[task_id], f"back at {step}")
        elif op == "start" and task_id in tokens:
            book.start(task_id, tokens[task_id], "w@h")
        elif op == "cancel":
            book.cancel(task_id)
        elif op == "prio":
            book.prioritize(task_id, rng.randrange(10))
        elif op == "hold":
            book.hold(task_id, float(step))
        elif op == "again" and task_id in tokens:
            book.give_back(task_id, tokens[task_id], "again", msg=_msg(task_id))
        if rng.random() < 0.3:
            _same(view, book)
    _same(view, book)


def test_jobs_admitted_between_others_take_their_place_in_admission_order(
    book: PendingBook,
) -> None:
    """The view keeps its records in index order while new jobs come last (the usual case)
    and reorders them when one is admitted with an earlier submit time."""
    view = PendingView(book, Clock())
    for n in (1, 3, 5):
        _admit(book, f"j{n}", float(n))
    assert list(view.records()) == ["j1", "j3", "j5"]
    _admit(book, "j6", 6.0)
    assert list(view.records()) == ["j1", "j3", "j5", "j6"], "a later job comes last"
    _admit(book, "j2", 2.0)
    _admit(book, "j7", 7.0)
    assert list(view.records()) == ["j1", "j2", "j3", "j5", "j6", "j7"], "an earlier one in place"
    _same(view, book)
