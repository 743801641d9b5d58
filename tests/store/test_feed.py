"""`store.feed` on a real Redis: a reader that re-reads only what changed gives, pass
after pass, what a full read gives."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from celery_ojs_ml.leader.pass_reads import feeds_of
from celery_ojs_ml.store.feed import FeedReader
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore

_TS_MS = 0.002
"""A heartbeat's `ts` comes from its expiry score, which is whole milliseconds."""


def _beat(store: OJSStore, name: str, free: int, ttl_s: float = 30.0) -> None:
    store.advertise(name, {"accelerator": "gpu"}, {"gpus": free}, ttl_s=ttl_s)


def _same(found: dict[str, Any], full: dict[str, Any]) -> None:
    assert list(found) == list(full), "the same workers, in index order"
    for name, record in full.items():
        assert {**found[name], "ts": 0} == {**record, "ts": 0}
        assert found[name]["ts"] == pytest.approx(record["ts"], abs=_TS_MS)


def _fleet(store: OJSStore, n: int = 5) -> FeedReader:
    for i in range(n):
        _beat(store, f"w{i}@h", 4)
    return feeds_of(store, LeaseBook(store, 30.0)).workers


def test_a_new_reader_reads_every_heartbeat(store: OJSStore) -> None:
    reader = _fleet(store)
    _same(reader.read(), store.live_workers())
    assert reader.read_values == 5


def test_a_heartbeat_that_changed_nothing_is_not_read_but_its_time_moves(
    redis_client: redis.Redis,
) -> None:
    """The refresh moves only the expiry score; the record's `ts` follows it."""
    now = [time.time()]
    store = OJSStore(redis_client, prefix="feed", clock=lambda: now[0])
    reader = _fleet(store)
    before = reader.read()
    now[0] += 2.5
    _beat(store, "w1@h", 4)
    found = reader.read()
    assert reader.read_values == 0
    assert found["w1@h"]["ts"] == pytest.approx(before["w1@h"]["ts"] + 2.5, abs=_TS_MS)
    _same(found, store.live_workers())


def test_a_heartbeat_that_changed_is_read_at_the_next_read(store: OJSStore) -> None:
    reader = _fleet(store)
    reader.read()
    _beat(store, "w2@h", 1)
    found = reader.read()
    assert reader.read_values == 1 and found["w2@h"]["free"] == {"gpus": 1}
    _same(found, store.live_workers())
    reader.read()
    assert reader.read_values == 0, "read once per change"


def test_a_worker_that_left_is_gone_and_a_new_one_appears(store: OJSStore) -> None:
    reader = _fleet(store)
    reader.read()
    store.forget_worker("w0@h")
    _beat(store, "new@h", 8)
    found = reader.read()
    assert "w0@h" not in found and found["new@h"]["free"] == {"gpus": 8}
    _same(found, store.live_workers())


def test_a_heartbeat_whose_key_expired_is_gone_though_its_index_entry_stays(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    reader = _fleet(store)
    reader.read()
    redis_client.delete(store.key("worker", "w3@h"))  # as its TTL would
    found = reader.read()
    assert "w3@h" not in found
    _same(found, store.live_workers())


def test_a_worker_back_after_expiry_with_nothing_changed_is_read_all_the_same(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """Its heartbeat goes to no feed (the same content as its last one), but the reader
    dropped it when it expired: it reads it by name."""
    reader = _fleet(store)
    reader.read()
    redis_client.delete(store.key("worker", "w3@h"))
    assert "w3@h" not in reader.read()
    _beat(store, "w3@h", 4)
    found = reader.read()
    assert found["w3@h"]["free"] == {"gpus": 4} and reader.read_values == 1
    _same(found, store.live_workers())


def test_a_feed_trimmed_past_the_readers_cursor_means_a_full_read(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    reader = _fleet(store)
    reader.read()
    redis_client.delete(store.worker_feed)  # a store restart loses it too
    store.client.set(store.key("worker", "w4@h"), b'{"capabilities": {}, "free": {}, "ts": 1}')
    found = reader.read()
    assert reader.read_values == 5, "every value read again"
    assert found["w4@h"]["free"] == {}


def test_a_reader_reads_everything_again_every_resync_period(store: OJSStore) -> None:
    now = [0.0]
    index, prefix, _ = store.live_read("worker")
    keys = (index, store.worker_feed, prefix)
    reader = FeedReader(store.client, keys, lambda v, s, r: v, resync_s=10.0, clock=lambda: now[0])
    _fleet(store)
    reader.read()
    now[0] = 9.0
    reader.read()
    assert reader.read_values == 0
    now[0] = 10.0
    reader.read()
    assert reader.read_values == 5


def test_a_heartbeat_that_failed_goes_to_the_feed_the_next_time(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """The writer remembers what it queued; a failed write forgets it, so the same
    content is announced again."""
    reader = _fleet(store)
    reader.read()
    commands = store.advertise_commands("w1@h", {"accelerator": "gpu"}, {"gpus": 0}, ttl_s=30)
    assert any(c[0] == "XADD" for c in commands)  # queued, never sent: the write failed
    store.advertise_failed("w1@h")
    _beat(store, "w1@h", 0)
    assert reader.read()["w1@h"]["free"] == {"gpus": 0}


def test_a_heartbeat_unchanged_but_for_its_time_adds_nothing_to_the_feed(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    _fleet(store, 2)
    length = redis_client.xlen(store.worker_feed)
    _beat(store, "w0@h", 4)
    assert redis_client.xlen(store.worker_feed) == length
    _beat(store, "w0@h", 3)
    assert redis_client.xlen(store.worker_feed) == length + 1


def test_a_heartbeat_of_a_writer_that_keeps_no_feed_is_read_on_every_pass(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """A worker of an earlier version writes its heartbeat without `fed` and appends to
    no feed: its changes are read all the same (a rolling upgrade)."""
    reader = _fleet(store, 2)
    key = store.key("worker", "old@h")

    def old_beat(free: int) -> None:
        redis_client.set(key, f'{{"capabilities": {{}}, "free": {{"gpus": {free}}}, "ts": 1.0}}')
        redis_client.zadd(store.key("index", "worker"), {"old@h": 9e12})

    old_beat(4)
    assert reader.read()["old@h"]["free"] == {"gpus": 4}
    old_beat(2)
    assert reader.read()["old@h"]["free"] == {"gpus": 2}
    assert reader.read_values == 1, "only the old writer's heartbeat is read again"


def test_leases_are_read_again_when_taken_or_claimed_never_when_refreshed(
    store: OJSStore,
) -> None:
    """A refresh moves only the deadline (the index score): the reader's lease follows
    it without reading the lease; a claim rewrites the lease and is read."""
    now = [1000.0]
    store = OJSStore(store.client, prefix="leasefeed", clock=lambda: now[0])
    book = LeaseBook(store, 30.0)
    reader = feeds_of(store, book).leases
    tokens = {t: book.take({"task_id": t, "worker": "a@h", "started_at": 1.0}) for t in "xyz"}
    assert [lease["task_id"] for lease in reader.read().values()] == ["x", "y", "z"]
    assert reader.read_values == 3
    now[0] = 1010.0
    assert book.refresh(tokens) == ([], [])
    found = reader.read()
    assert reader.read_values == 0, "a refresh is not read"
    assert found["x"]["deadline"] == 1030.0, "changes only: the deadline of its last write"
    assert _undated(found.values()) == _undated(book.all())
    now[0] = 1041.0
    claimed = book.claim("y", "b@h", "i2")
    assert claimed is not None
    found = reader.read()
    assert reader.read_values == 1 and found["y"]["worker"] == "b@h"
    assert book.release("z", tokens["z"])
    found = reader.read()
    assert set(found) == {"x", "y"} and _undated(found.values()) == _undated(book.all())


def _undated(leases: Any) -> list[dict[str, Any]]:
    return sorted(({k: v for k, v in x.items() if k != "deadline"} for x in leases),
                  key=lambda x: str(x["task_id"]))  # fmt: skip


def test_a_lease_written_without_the_feed_is_found_by_the_next_full_read(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """A writer of an earlier version adds a lease to the index without a stream entry:
    the changes-only read sees the index grow and reads everything the next time."""
    book = LeaseBook(store, 30.0)
    reader = feeds_of(store, book).leases
    book.take({"task_id": "new", "worker": "a@h", "started_at": 1.0})
    reader.read()
    old = {"task_id": "old", "worker": "a@h", "deadline": 50.0}
    redis_client.set(store.lease_key("old"), json.dumps(old))
    redis_client.zadd(store.key("leases"), {"old": 50.0})
    assert set(reader.read()) == {"new"}, "not in the stream"
    assert set(reader.read()) == {"new", "old"}, "the index's size told"
    redis_client.delete(store.lease_key("old"))
    redis_client.zrem(store.key("leases"), "old")
    assert set(reader.read()) == {"new"}, "an unfed lease is looked for in the index"
