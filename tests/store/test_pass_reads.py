"""`leader.pass_reads` on a real Redis: a leader pass's first reads in one round trip
give what the reads one by one give (the pending view, live workers, leases)."""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import redis

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.leader.ledger import Ledger
from celery_ojs_ml.leader.pass_inputs import started_at as started_from
from celery_ojs_ml.leader.pass_reads import feeds_of, read_pass
from celery_ojs_ml.leader.pending_view import PendingView
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.reservations import ReservationBook


def _msg(task_id: str) -> dict[str, Any]:
    return {"body": f"payload-of-{task_id}", "headers": {"id": task_id, "task": "t"}}


def _fleet(store: OJSStore) -> tuple[PendingBook, LeaseBook, str]:
    book, leases = PendingBook(store), LeaseBook(store, 30.0)
    for n in range(4):
        assert book.admit(f"j{n}", {"submitted_at": float(n), "queue": "ml"}, _msg(f"j{n}"))
    for name in ("a@h", "b@h"):
        store.advertise(name, {"accelerator": "cpu"}, {"gpus": 0}, ttl_s=30)
    token = book.assign("j1", "a@h", now=1.0)
    assert token is not None
    leases.take({"task_id": "r1", "worker": "a@h", "started_at": 1.0})
    return book, leases, ReservationBook(store).key


def test_one_round_trip_gives_what_the_reads_one_by_one_give(store: OJSStore) -> None:
    book, leases, resv = _fleet(store)
    reads = read_pass(store, book, resv, [], feeds_of(store, leases))
    assert reads is not None
    assert reads.index == ["j0", "j1", "j2", "j3"]
    assert reads.changed == {"j1"}, "the assignment marked j1 changed"
    assert reads.reserving is False
    assert reads.workers == store.live_workers()
    assert reads.leases == leases.all()
    assert book.index_and_changes()[1] == set(), "the marks were taken"
    fresh = PendingView(book).records()
    seen = PendingView(book).records((reads.index, reads.changed))
    assert seen == fresh


def test_a_change_after_the_pass_read_is_read_at_the_next_pass(store: OJSStore) -> None:
    book, leases, resv = _fleet(store)
    view = PendingView(book)
    first = read_pass(store, book, resv, [], feeds_of(store, leases))
    assert first is not None
    view.records((first.index, first.changed))
    assert book.give_back("j1", str(book.read(["j1"])["j1"]["token"]), "did not fit")
    second = read_pass(store, book, resv, [], feeds_of(store, leases))
    assert second is not None and second.changed == {"j1"}
    assert view.records((second.index, second.changed))["j1"]["state"] == "pending"


def test_after_the_server_lost_the_script_the_pass_still_reads_everything(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """SCRIPT FLUSH (a restart; also a fresh server): the workers and leases are read
    again one by one, which loads the script, so the next pass is one round trip again."""
    book, leases, resv = _fleet(store)
    redis_client.script_flush()
    feeds = feeds_of(store, leases)
    reads = read_pass(store, book, resv, [], feeds)
    assert reads is not None and reads.index
    assert set(reads.workers) == {"a@h", "b@h"} and len(reads.leases) == 1
    assert redis_client.script_exists(feeds.workers.sha, feeds.leases.sha) == [True, True]
    again = read_pass(store, book, resv, [], feeds)
    assert again is not None and json.dumps(again.leases) == json.dumps(leases.all())


def test_a_store_without_lua_reads_one_by_one() -> None:
    store = OJSStore(fakeredis.FakeRedis(), prefix="t")
    book, leases, resv = _fleet(store)
    store.live_workers()  # the first script call finds no Lua and remembers it
    assert read_pass(store, book, resv, [], feeds_of(store, leases)) is None


def test_the_start_times_of_assigned_jobs_ride_the_same_round_trip(store: OJSStore) -> None:
    """`Ledger.used` asks when the jobs it saw assigned started: read with the pass."""
    book, leases, resv = _fleet(store)
    token = book.assign("j2", "b@h", now=2.0)
    assert token is not None and book.start("j2", token, "b@h") == "ok"
    reads = read_pass(store, book, resv, ["j1", "j2", "gone"], feeds_of(store, leases))
    assert reads is not None
    assert reads.started == book.started_at(["j1", "j2", "gone"])
    assert reads.started["j1"] is None and reads.started["gone"] is None
    assert isinstance(reads.started["j2"], float)


def _admission(book: PendingBook, jobs: list[str], acked: list[list[bool]]) -> Any:
    def before(pipe: Any) -> Any:
        finish = book.admit_in(pipe, [(t, {"submitted_at": 9.0}, _msg(t)) for t in jobs])
        assert finish is not None
        return lambda reply: acked.append(finish(reply))

    return before


def test_the_intakes_admission_rides_ahead_of_the_reads_which_see_the_jobs(
    store: OJSStore,
) -> None:
    """The leader's hop from intake to assignment: admission and first reads, one trip."""
    book, leases, resv = _fleet(store)
    acked: list[list[bool]] = []
    reads = read_pass(
        store,
        book,
        resv,
        [],
        feeds_of(store, leases),
        _admission(book, ["n1", "j0"], acked),
    )
    assert reads is not None and acked == [[True, False]], "j0 was admitted before"
    assert reads.index == ["j0", "j1", "j2", "j3", "n1"]
    record = book.get("n1")
    assert record is not None and record["state"] == "pending"
    assert record["msg"] == _msg("n1")


def test_an_admission_the_server_has_no_script_for_is_admitted_all_the_same(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """SCRIPT FLUSH: the admission's EVALSHA fails, so it is admitted through the script,
    which loads it; nothing is lost and the job is there for the next pass."""
    book, leases, resv = _fleet(store)
    redis_client.script_flush()
    acked: list[list[bool]] = []
    reads = read_pass(
        store, book, resv, [], feeds_of(store, leases), _admission(book, ["n2"], acked)
    )
    assert reads is not None and acked == [[True]]
    record = book.get("n2")
    assert record is not None and record["state"] == "pending"
    again = read_pass(store, book, resv, [], feeds_of(store, leases))
    assert again is not None and "n2" in again.index


def test_a_job_started_between_the_first_reads_and_the_record_reads_keeps_its_gpus(
    store: OJSStore,
) -> None:
    """The first reads take the ledger's start times before the view reads the changed
    records: a gate that starts the job in between leaves a record that says started
    and a start time that says not. The leader reads the start again, so the ledger
    keeps the job's GPUs until a heartbeat newer than its start (before the fix it fell
    back to the last pass that saw the job assigned, dropped the job from the ledger on
    an older heartbeat and assigned its GPU twice: the gate gave one job back)."""
    book, leases, resv = _fleet(store)
    view = PendingView(book)
    ledger = Ledger()
    ledger.assigned("j1", "a@h", Demand(gpus=1), now=1.0)
    ledger.used({"j1": {"state": "assigned", "worker": "a@h"}}, {"a@h": 0.5}, {}, now=1.0)
    first = read_pass(store, book, resv, ["j1"], feeds_of(store, leases))
    assert first is not None and first.started == {"j1": None}, "read before the gate's start"
    assert "j1" in first.changed, "its assignment marked it changed: the view reads it again"
    token = str(book.read(["j1"])["j1"]["token"])
    assert book.start("j1", token, "a@h") == "ok"  # the gate starts it now
    records = view.records((first.index, first.changed))
    assert records.get("j1") is None, "the record reads show it has left the assigned state"

    def reads_start(ids: list[str]) -> dict[str, float | None]:
        return started_from(book, first.started, ids)

    started_at = float(book.started_at(["j1"])["j1"] or 0.0)
    heartbeat = (1.0 + started_at) / 2  # newer than the last sighting, older than the start
    used = ledger.used(records, {"a@h": heartbeat}, {}, started_at, reads_start)
    assert used == {"a@h": Demand(gpus=1)}, "its GPU is still counted"
    assert ledger.used(records, {"a@h": started_at + 1}, {}, started_at + 1, reads_start) == {}
