"""PendingBook on a real Redis (DESIGN decision 9): the durable pending set of the scheduler.

Every state change is one WATCH/MULTI transaction on one job's hash; the
scheduler lock is a `SET NX PX` that only its holder renews.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.pending import (
    ASSIGNED,
    HEADER_MSG,
    PENDING,
    STARTED,
    TOMBSTONE_S,
    PendingBook,
)
from celery_ojs_ml.store.registry import OJSStore


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def book(store: OJSStore) -> PendingBook:
    return PendingBook(store)


def _msg(task_id: str) -> dict[str, Any]:
    return {
        "body": f"payload-of-{task_id}",
        "headers": {"id": task_id, "task": "train", "argsrepr": "(1, 2)"},
        "properties": {"delivery_info": {"routing_key": "ml"}, "priority": 0},
    }


def _meta(submitted_at: float, **extra: Any) -> dict[str, Any]:
    return {"submitted_at": submitted_at, "queue": "ml", "gpus": 2, **extra}


def _admitted(book: PendingBook, task_id: str = "job-1", at: float = 100.0) -> str:
    assert book.admit(task_id, _meta(at), _msg(task_id)) is True
    return task_id


def _assigned(book: PendingBook, task_id: str = "job-1", worker: str = "w1@host") -> str:
    _admitted(book, task_id)
    token = book.assign(task_id, worker, now=200.0)
    assert token is not None
    return token


# -- admission ------------------------------------------------------------------------------


def test_admitted_jobs_are_listed_in_submission_order_with_meta_and_message_kept(
    book: PendingBook,
) -> None:
    # The ids sort the other way round, so the order can only come from submitted_at.
    book.admit("job-c", _meta(10.0, priority_hint=1), _msg("job-c"))
    book.admit("job-b", _meta(20.0), _msg("job-b"))
    book.admit("job-a", _meta(30.0), _msg("job-a"))
    records = book.records()
    assert list(records) == ["job-c", "job-b", "job-a"]
    first = records["job-c"]
    assert first["state"] == PENDING
    assert first["meta"] == _meta(10.0, priority_hint=1)
    assert first["msg"] == _msg("job-c")
    assert "token" not in first and "worker" not in first
    assert book.get("job-b") == records["job-b"]


def test_get_of_an_unknown_job_is_none_and_an_empty_book_has_no_records(
    book: PendingBook,
) -> None:
    assert book.get("nope") is None
    assert book.records() == {}


def test_admission_records_the_store_clock(redis_client: redis.Redis) -> None:
    clock = Clock()
    book = PendingBook(OJSStore(redis_client, prefix="pt-clock", clock=clock))
    _admitted(book)
    record = book.get("job-1")
    assert record is not None and float(record["admitted_at"]) == 5000.0


def test_a_job_already_waiting_or_assigned_is_not_admitted_twice(book: PendingBook) -> None:
    _admitted(book, "job-1")
    assert book.admit("job-1", _meta(999.0), {"body": "other"}) is False
    record = book.get("job-1")
    assert record is not None and record["msg"] == _msg("job-1")
    token = book.assign("job-1", "w1@host", now=1.0)
    assert token is not None
    assert book.admit("job-1", _meta(999.0), {"body": "other"}) is False
    record = book.get("job-1")
    assert record is not None and record["state"] == ASSIGNED and record["token"] == token


def test_a_started_job_republished_under_its_id_is_admitted_again_as_new(
    book: PendingBook,
) -> None:
    token = _assigned(book, "job-1")
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.admit("job-1", _meta(300.0), _msg("job-1")) is True
    record = book.get("job-1")
    assert record is not None and record["state"] == PENDING
    assert "token" not in record and "started_at" not in record
    assert list(book.records()) == ["job-1"]


def test_a_message_admitted_once_is_not_admitted_again_after_its_job_started(
    book: PendingBook,
) -> None:
    """DESIGN decision 9 (no job runs twice): an intake message redelivered after the
    leader that admitted it died is recognised by its `ojs_msg` id, while a re-publish
    (a new id) of the started job is admitted again."""
    first = {**_msg("job-1"), "headers": {**_msg("job-1")["headers"], HEADER_MSG: "m-1"}}
    assert book.admit("job-1", _meta(100.0), first) is True
    token = book.assign("job-1", "w1@host", now=200.0)
    assert token is not None and book.start("job-1", token, "w1@host") == "ok"
    assert book.admit("job-1", _meta(100.0), first) is False  # the same message again
    record = book.get("job-1")
    assert record is not None and record["state"] == STARTED
    again = {**first, "headers": {**first["headers"], HEADER_MSG: "m-2"}}
    assert book.admit("job-1", _meta(300.0), again) is True  # a re-publish: a new message
    record = book.get("job-1")
    assert record is not None and record["state"] == PENDING
    assert record["seen"] == ["m-1", "m-2"]
    token = book.assign("job-1", "w1@host", now=400.0)
    assert token is not None and book.start("job-1", token, "w1@host") == "ok"
    assert book.admit("job-1", _meta(100.0), first) is False  # still known after two runs


def test_lean_records_match_full_records_and_see_a_readmitted_message(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    """The leader's per-pass read (`records(lean=True)`) skips the unchanged message of an
    admission it already holds, but never serves a stale one."""
    _admitted(book, "job-1", at=100.0)
    token = _assigned(book, "job-2")
    lean = book.records(lean=True)
    full = book.records()
    assert list(lean) == list(full) == ["job-1", "job-2"]
    for task_id in full:
        assert lean[task_id]["msg"] == full[task_id]["msg"]
        for name in ("state", "meta", "worker", "token", "assigned_at"):
            assert lean[task_id].get(name) == full[task_id].get(name), name
    assert book.records(lean=True)["job-2"]["token"] == token  # cached message, fresh fields
    assert book.start("job-2", token, "w1@host") == "ok"
    changed = {**_msg("job-2"), "body": "the re-published payload"}
    assert book.admit("job-2", _meta(300.0), changed) is True
    again = book.records(lean=True)
    assert again["job-2"]["msg"]["body"] == "the re-published payload"
    assert again["job-2"]["state"] == PENDING and "token" not in again["job-2"]


def test_records_drop_index_entries_whose_hash_is_gone(
    book: PendingBook, store: OJSStore, redis_client: redis.Redis
) -> None:
    _admitted(book, "job-1", at=1.0)
    _admitted(book, "job-2", at=2.0)
    redis_client.delete(store.key("pjob", "job-1"))  # e.g. lost with a failover
    assert list(book.records()) == ["job-2"]
    assert redis_client.zrange(store.key("pjobs"), 0, -1) == [b"job-2"]


# -- assignment -----------------------------------------------------------------------------


def test_assign_returns_a_token_and_marks_the_job_assigned_to_the_worker(
    book: PendingBook,
) -> None:
    _admitted(book)
    token = book.assign("job-1", "w1@host", now=123.5, victims=["old-1", "old-2"])
    assert isinstance(token, str) and len(token) == 32
    record = book.get("job-1")
    assert record is not None
    assert record["state"] == ASSIGNED
    assert record["worker"] == "w1@host"
    assert record["token"] == token
    assert float(record["assigned_at"]) == 123.5
    assert record["victims"] == ["old-1", "old-2"]
    assert record["msg"] == _msg("job-1"), "the message is kept until the job starts"
    assert list(book.records()) == ["job-1"], "an assigned job is still in the set"


def test_assign_of_a_job_that_is_not_pending_returns_none(book: PendingBook) -> None:
    assert book.assign("unknown", "w1@host", now=1.0) is None
    token = _assigned(book, "job-1", worker="w1@host")
    assert book.assign("job-1", "w2@host", now=2.0) is None
    record = book.get("job-1")
    assert record is not None and record["worker"] == "w1@host" and record["token"] == token
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.assign("job-1", "w2@host", now=3.0) is None


def test_each_assignment_gets_a_fresh_token(book: PendingBook) -> None:
    first = _assigned(book)
    assert book.take_back("job-1", first, "timeout") is True
    second = book.assign("job-1", "w2@host", now=300.0)
    assert second is not None and second != first


def _race_to_assign(
    book: PendingBook,
    task_id: str,
    worker: str,
    barrier: threading.Barrier,
    tokens: dict[str, str | None],
    errors: list[BaseException],
) -> None:
    try:
        barrier.wait(timeout=5)
        tokens[worker] = book.assign(task_id, worker, now=1.0)
    except BaseException as exc:  # surfaced in the main thread
        errors.append(exc)


def test_two_threads_assigning_the_same_job_exactly_one_gets_a_token(
    redis_url: str, redis_client: redis.Redis
) -> None:
    prefix = f"pt-race-{uuid.uuid4().hex[:6]}"
    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    books = [PendingBook(OJSStore(c, prefix=prefix)) for c in clients]
    rounds = 40
    try:
        for i in range(rounds):
            _admitted(books[0], f"job-{i}", at=float(i))
        for i in range(rounds):
            task_id = f"job-{i}"
            barrier = threading.Barrier(2)
            tokens: dict[str, str | None] = {}
            errors: list[BaseException] = []
            threads = [
                threading.Thread(
                    target=_race_to_assign,
                    args=(b, task_id, f"w{n}@host", barrier, tokens, errors),
                )
                for n, b in enumerate(books)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            assert errors == []
            winners = {w: tok for w, tok in tokens.items() if tok is not None}
            assert len(tokens) == 2 and len(winners) == 1, f"round {i}: {tokens}"
            ((worker, token),) = winners.items()
            record = books[0].get(task_id)
            assert record is not None
            assert record["worker"] == worker and record["token"] == token
    finally:
        for c in clients:
            c.close()


# -- start ----------------------------------------------------------------------------------


def test_start_with_the_current_token_leaves_a_tombstone_kept_for_a_day(
    book: PendingBook, store: OJSStore, redis_client: redis.Redis
) -> None:
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.records() == {}
    assert redis_client.zscore(store.key("pjobs"), "job-1") is None
    tombstone = book.get("job-1")
    assert tombstone is not None
    assert tombstone["state"] == STARTED and tombstone["token"] == token
    assert "started_at" in tombstone
    assert "msg" not in tombstone, "the message is not kept once the job runs"
    ttl = redis_client.ttl(store.key("pjob", "job-1"))
    assert TOMBSTONE_S == 86400
    assert TOMBSTONE_S - 60 < ttl <= TOMBSTONE_S


def test_start_with_a_wrong_token_is_stale_and_changes_nothing(book: PendingBook) -> None:
    token = _assigned(book)
    before = book.get("job-1")
    assert book.start("job-1", "not-" + token, "w1@host") == "stale"
    assert book.get("job-1") == before
    assert list(book.records()) == ["job-1"]


def test_start_of_a_job_that_was_never_assigned_is_stale(book: PendingBook) -> None:
    _admitted(book)
    assert book.start("job-1", uuid.uuid4().hex, "w1@host") == "stale"
    record = book.get("job-1")
    assert record is not None and record["state"] == PENDING


def test_start_again_with_the_same_token_after_it_started_is_again(book: PendingBook) -> None:
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    first = book.get("job-1")
    assert book.start("job-1", token, "w1@host") == "again"
    assert book.get("job-1") == first, "a second delivery does not rewrite the tombstone"
    assert book.start("job-1", "other-token", "w2@host") == "stale"


def test_start_of_an_unknown_job_is_unknown(book: PendingBook) -> None:
    assert book.start("nobody", "any-token", "w1@host") == "unknown"
    assert book.get("nobody") is None, "start does not create a record"


# -- give back and take back ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["give_back", "take_back"])
def test_returning_with_the_right_token_makes_the_job_pending_with_the_reason(
    book: PendingBook, how: str
) -> None:
    token = _assigned(book)
    assert getattr(book, how)("job-1", token, "no room on w1") is True
    record = book.get("job-1")
    assert record is not None
    assert record["state"] == PENDING
    assert record["reason"] == "no room on w1"
    for gone in ("token", "worker", "assigned_at"):
        assert gone not in record
    assert record["msg"] == _msg("job-1")
    assert list(book.records()) == ["job-1"]
    assert book.assign("job-1", "w2@host", now=400.0) is not None, "it can be assigned again"


@pytest.mark.parametrize("how", ["give_back", "take_back"])
def test_returning_with_a_wrong_token_changes_nothing(book: PendingBook, how: str) -> None:
    token = _assigned(book)
    before = book.get("job-1")
    assert getattr(book, how)("job-1", "not-" + token, "late") is False
    assert book.get("job-1") == before
    assert getattr(book, how)("unknown", token, "late") is False
    assert book.get("unknown") is None


def test_returning_a_started_job_changes_nothing(book: PendingBook) -> None:
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.take_back("job-1", token, "timeout") is False
    record = book.get("job-1")
    assert record is not None and record["state"] == STARTED
    assert book.records() == {}


def test_a_started_job_given_back_with_its_redelivered_message_waits_again(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    """A copy delivered again after its run died unleased is the job's only copy (no loss)."""
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    again = {**_msg("job-1"), "body": "the-redelivered-copy"}
    assert book.give_back("job-1", token, "no room", msg=again) is True
    record = book.get("job-1")
    assert record is not None and record["state"] == PENDING
    assert record["msg"] == again and record["reason"] == "no room"
    for gone in ("token", "worker", "assigned_at", "started_at"):
        assert gone not in record
    assert redis_client.ttl(book._key("job-1")) == -1, "a waiting job has no tombstone expiry"
    assert list(book.records()) == ["job-1"]
    assert book.assign("job-1", "w2@host", now=600.0) is not None, "it is placed again"


def test_a_started_job_is_given_back_only_with_its_own_token_and_message(
    book: PendingBook,
) -> None:
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.give_back("job-1", token, "no room") is False, "no message: nothing to restore"
    assert book.give_back("job-1", "not-" + token, "late", msg=_msg("job-1")) is False
    record = book.get("job-1")
    assert record is not None and record["state"] == STARTED
    assert book.records() == {}


def test_a_start_with_the_token_of_a_taken_back_assignment_is_stale(book: PendingBook) -> None:
    old = _assigned(book, worker="w1@host")
    assert book.take_back("job-1", old, "worker w1@host did not start it in time") is True
    assert book.start("job-1", old, "w1@host") == "stale"
    new = book.assign("job-1", "w2@host", now=500.0)
    assert new is not None
    assert book.start("job-1", old, "w1@host") == "stale"
    assert book.start("job-1", new, "w2@host") == "ok"
    record = book.get("job-1")
    assert record is not None and record["worker"] == "w2@host"


# -- RFC 27 annotate, cancel, prioritize ----------------------------------------------------


def test_annotate_writes_reason_estimate_and_worker_readable_through_get(
    book: PendingBook,
) -> None:
    _admitted(book, "job-1", at=1.0)
    _admitted(book, "job-2", at=2.0)
    book.annotate(
        {
            "job-1": ("waiting for 2 GPUs", 1234.5, "w1@host"),
            "job-2": ("no worker has the constraint", None, None),
        }
    )
    one = book.get("job-1")
    two = book.get("job-2")
    assert one is not None and two is not None
    assert one["annotation"] == {
        "reason_pending": "waiting for 2 GPUs",
        "t_estimate": 1234.5,
        "worker": "w1@host",
    }
    assert two["annotation"] == {
        "reason_pending": "no worker has the constraint",
        "t_estimate": None,
        "worker": None,
    }
    assert one["state"] == PENDING and one["msg"] == _msg("job-1"), "annotate adds, no more"
    assert book.records()["job-1"]["annotation"]["t_estimate"] == 1234.5


def test_annotate_with_no_notes_touches_nothing(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    book.annotate({})
    assert redis_client.dbsize() == 0


def test_cancel_removes_a_waiting_job(
    book: PendingBook, store: OJSStore, redis_client: redis.Redis
) -> None:
    _admitted(book, "job-1", at=1.0)
    _admitted(book, "job-2", at=2.0)
    assert book.cancel("job-1") is True
    tombstone = book.get("job-1")
    assert tombstone is not None and tombstone["state"] == "cancelled" and "msg" not in tombstone
    assert 86340 <= int(redis_client.ttl(store.key("pjob", "job-1"))) <= 86400
    assert list(book.records()) == ["job-2"]
    assert redis_client.zscore(store.key("pjobs"), "job-1") is None
    assert book.cancel("job-1") is False, "a second cancel finds nothing"


def test_cancel_of_an_unknown_job_returns_false(book: PendingBook) -> None:
    assert book.cancel("nobody") is False
    assert book.get("nobody") is None


def test_cancel_of_a_started_job_returns_false_and_keeps_the_tombstone(
    book: PendingBook,
) -> None:
    token = _assigned(book)
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.cancel("job-1") is False
    record = book.get("job-1")
    assert record is not None and record["state"] == STARTED
    assert book.start("job-1", token, "w1@host") == "again"


def test_cancel_drops_an_assigned_job_and_its_copy_in_flight_is_stale_at_the_gate(
    book: PendingBook,
) -> None:
    token = _assigned(book)
    assert book.cancel("job-1") is True
    assert book.records() == {}
    assert book.take_back("job-1", token, "timeout") is False
    assert book.start("job-1", token, "w1@host") == "stale", "a cancelled job never runs"
    assert book.admit("job-1", {"submitted_at": 1.0}, {"body": ""}) is False, "nor comes back"


def test_a_late_annotation_of_a_gone_job_does_not_make_its_start_stale(book: PendingBook) -> None:
    book.annotate({"gone": ("reason", None, None)})
    assert book.start("gone", "any-token", "w1@host") == "unknown"
    assert book.records() == {}


def test_prioritize_sets_the_priority_of_a_waiting_job(book: PendingBook) -> None:
    _admitted(book)
    assert book.prioritize("job-1", 7) is True
    record = book.get("job-1")
    assert record is not None and record["priority"] == "7"
    assert book.prioritize("job-1", -3) is True
    record = book.get("job-1")
    assert record is not None and record["priority"] == "-3"
    assert record["state"] == PENDING and record["msg"] == _msg("job-1")


def test_prioritize_of_a_job_that_does_not_wait_returns_false(book: PendingBook) -> None:
    assert book.prioritize("nobody", 5) is False
    assert book.get("nobody") is None
    _assigned(book, "job-1")
    assert book.prioritize("job-1", 5) is False
    record = book.get("job-1")
    assert record is not None and "priority" not in record


# -- the scheduler lock ---------------------------------------------------------------------


@pytest.fixture
def lock_book(redis_client: redis.Redis) -> Iterator[tuple[PendingBook, Clock, OJSStore]]:
    clock = Clock()
    store = OJSStore(redis_client, prefix=f"pt-lock-{uuid.uuid4().hex[:6]}", clock=clock)
    yield PendingBook(store), clock, store


def test_the_first_candidate_takes_the_lock_and_a_second_loses_while_it_is_held(
    lock_book: tuple[PendingBook, Clock, OJSStore],
) -> None:
    book, _, _ = lock_book
    assert book.leader() is None
    assert book.lead("sched-a", 30.0) is True
    assert book.lead("sched-b", 30.0) is False
    assert book.leader() == {"id": "sched-a", "since": 5000.0}


def test_the_holder_renews_the_lock_and_keeps_since(
    lock_book: tuple[PendingBook, Clock, OJSStore], redis_client: redis.Redis
) -> None:
    book, clock, store = lock_book
    key = store.key("scheduler", "leader")
    assert book.lead("sched-a", 0.6) is True
    assert 0 < redis_client.pttl(key) <= 600
    clock.now = 5010.0
    assert book.lead("sched-a", 30.0) is True
    assert redis_client.pttl(key) > 25_000, "the renewal extended the expiry"
    assert book.leader() == {"id": "sched-a", "since": 5000.0}
    assert book.lead("sched-b", 30.0) is False


def test_resign_releases_the_lock_only_for_its_holder(
    lock_book: tuple[PendingBook, Clock, OJSStore],
) -> None:
    book, _, _ = lock_book
    assert book.lead("sched-a", 30.0) is True
    book.resign("sched-b")
    assert book.leader() is not None and book.leader() == {"id": "sched-a", "since": 5000.0}
    book.resign("sched-a")
    assert book.leader() is None
    assert book.lead("sched-b", 30.0) is True
    leader = book.leader()
    assert leader is not None and leader["id"] == "sched-b"


def test_another_candidate_wins_once_the_lock_expires(
    lock_book: tuple[PendingBook, Clock, OJSStore],
) -> None:
    book, clock, _ = lock_book
    assert book.lead("sched-a", 0.6) is True
    assert book.lead("sched-b", 0.6) is False
    time.sleep(0.9)
    assert book.leader() is None
    clock.now = 6000.0
    assert book.lead("sched-b", 0.6) is True
    assert book.leader() == {"id": "sched-b", "since": 6000.0}
    assert book.lead("sched-a", 0.6) is False


def test_leader_returns_id_and_since_of_the_holder(
    lock_book: tuple[PendingBook, Clock, OJSStore],
) -> None:
    book, _, _ = lock_book
    book.lead("sched-a", 30.0)
    leader = book.leader()
    assert leader is not None
    assert set(leader) == {"id", "since"}
    assert leader["id"] == "sched-a" and leader["since"] == 5000.0


def test_start_without_lua_scripting_decides_exactly_as_the_script(book: PendingBook) -> None:
    """Stores without scripting (fakeredis in the demo) take the WATCH/MULTI path."""
    book._start_script = None
    assert book.start("nobody", "t", "w1@host") == "unknown"
    token = _assigned(book)
    assert book.start("job-1", "wrong", "w1@host") == "stale"
    assert book.start("job-1", token, "w1@host") == "ok"
    assert book.start("job-1", token, "w1@host") == "again"
    assert book.records() == {}


def test_a_batch_admission_admits_new_jobs_and_skips_known_ones(book: PendingBook) -> None:
    _admitted(book, "job-1", at=1.0)
    fresh = book.admit_many(
        [
            ("job-1", {"submitted_at": 1.0}, {"body": "again"}),
            ("job-2", {"submitted_at": 2.0}, {"body": "b"}),
            ("job-3", {"submitted_at": 3.0}, {"body": "c"}),
        ]
    )
    assert fresh == [False, True, True]
    assert list(book.records()) == ["job-1", "job-2", "job-3"]
    record = book.get("job-1")
    assert record is not None and record["msg"] != {"body": "again"}, "the first copy stays"


def test_a_job_given_back_records_when_so_the_leader_can_back_off(book: PendingBook) -> None:
    from celery_ojs_ml.leader.pass_inputs import cooled_at

    token = _assigned(book)
    assert book.give_back("job-1", token, "anti-affinity holds on a running job") is True
    record = book.get("job-1")
    assert record is not None and float(record["returned_at"]) > 0
    at = float(record["returned_at"])
    assert at + 0.1 < cooled_at(record), "not re-offered at once"
    assert at + 0.6 > cooled_at(record), "re-offered after the backoff"


@pytest.mark.parametrize("lua", [True, False])
def test_admission_with_and_without_lua_keeps_the_same_records(store: OJSStore, lua: bool) -> None:
    """`admit_many` runs one Lua script; stores without Lua use WATCH/MULTI: same records."""
    book = PendingBook(store)
    if not lua:
        book.admission._admit_script = None
    meta = _meta(7.0)
    first = {**_msg("j"), "headers": {**_msg("j")["headers"], HEADER_MSG: "m-0"}}
    assert book.admit_many([("j", meta, first), ("k", meta, _msg("k"))]) == [True, True]
    assert book.admit_many([("j", meta, first)]) == [False], "waiting: not admitted twice"
    token = book.assign("j", "w@h", now=8.0)
    assert token is not None and book.start("j", token, "w@h") == "ok"
    assert book.admit_many([("j", meta, first)]) == [False], "the same message: seen"
    for n in range(1, 40):  # re-published copies, each a new message
        again = {**first, "headers": {**first["headers"], HEADER_MSG: f"m-{n}"}}
        assert book.admit_many([("j", meta, again)]) == [True]
        token = book.assign("j", "w@h", now=9.0)
        assert token is not None and book.start("j", token, "w@h") == "ok"
    record = book.get("j")
    assert record is not None and record["seen"] == [f"m-{n}" for n in range(7, 40)][-32:]
    waiting = book.get("k")
    assert waiting is not None
    assert (waiting["state"], waiting["meta"], waiting["msg"]) == (PENDING, meta, _msg("k"))
    assert "seen" not in waiting or waiting["seen"] == []
    assert list(book.records()) == ["k"]


def test_assign_many_assigns_in_one_pipeline_and_skips_jobs_no_longer_pending(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    """A pass's assignments in one round trip (`assign_many`): each is the same Lua
    compare-and-set as `assign`, so a job not pending any more gets None, and each
    delivery is pushed only with its own assignment."""
    for task_id in ("a", "b", "c"):
        _admitted(book, task_id)
    taken = _assigned(book, "d", worker="w0@host")
    items = [
        ("a", "w1@host", "tok-a", ("ojs-test-list", b"msg-a")),
        ("d", "w1@host", "tok-d", ("ojs-test-list", b"msg-d")),
        ("b", "w2@host", "tok-b", None),
        ("c", "w1@host", "tok-c", ("ojs-test-list", b"msg-c")),
    ]
    assert book.assign_many(items, now=42.0) == ["tok-a", None, "tok-b", "tok-c"]
    for task_id, worker in (("a", "w1@host"), ("b", "w2@host"), ("c", "w1@host")):
        record = book.get(task_id)
        assert record is not None and record["state"] == ASSIGNED
        assert record["worker"] == worker and record["token"] == f"tok-{task_id}"
        assert float(record["assigned_at"]) == 42.0 and record["victims"] == []
    record = book.get("d")
    assert record is not None and record["token"] == taken, "the earlier assignment stands"
    assert redis_client.lrange("ojs-test-list", 0, -1) == [b"msg-c", b"msg-a"]


def test_assign_many_without_lua_scripting_decides_exactly_as_the_script(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    book.assigner._assign_script = None
    _admitted(book, "a")
    _admitted(book, "b")
    book.cancel("b")
    items = [("a", "w1@host", "tok-a", ("ojs-test-list", b"msg-a")), ("b", "w1@host", "t", None)]
    assert book.assign_many(items, now=1.0) == ["tok-a", None]
    assert redis_client.lrange("ojs-test-list", 0, -1) == [b"msg-a"]


def test_assign_many_writes_the_pass_annotations_in_the_same_pipeline_without_script_exists(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    """No `SCRIPT EXISTS` round trip per pass (redis-py's pipelined Script asks it): the
    assignments go out as bare EVALSHA, with the notes of the jobs left waiting."""
    for task_id in ("a", "b", "c"):
        _admitted(book, task_id)
    book.assign("x-load", "w1@host", now=0.0)  # the server holds the script now
    before = redis_client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)
    notes = {"b": ("no worker has 1 GPU free", 99.0, "w1@host")}
    items = [("a", "w1@host", "tok-a", None), ("c", "w2@host", "tok-c", None)]
    assert book.assign_many(items, now=5.0, notes=notes) == ["tok-a", "tok-c"]
    after = redis_client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)
    assert after == before
    record = book.get("b")
    assert record is not None and record["state"] == "pending"
    assert json.loads(redis_client.hget(book._key("b"), "annotation") or b"{}") == {
        "reason_pending": "no worker has 1 GPU free",
        "t_estimate": 99.0,
        "worker": "w1@host",
    }


def test_assign_many_after_the_server_lost_the_script_assigns_every_job(
    book: PendingBook, redis_client: redis.Redis
) -> None:
    """SCRIPT FLUSH (a restart): the pipeline's EVALSHAs fail; each job is assigned again
    through the script, which loads it, and none is lost or assigned twice."""
    for task_id in ("a", "b"):
        _admitted(book, task_id)
    redis_client.script_flush()
    items = [("a", "w1@host", "tok-a", None), ("b", "w2@host", "tok-b", None)]
    assert book.assign_many(items, now=3.0) == ["tok-a", "tok-b"]
    assert [book.get(t)["token"] for t in ("a", "b")] == ["tok-a", "tok-b"]  # type: ignore[index]
    assert book.assign_many(items, now=4.0) == [None, None], "a second assignment is refused"
