"""A publisher's grants copy (`store.grants.GrantWatch`) against a real redis-server.

The copy must answer as an HGET sent at the same moment would: every write whose reply
the writer has is seen by the next lookup, in RESP2 and RESP3, and a broken or forked
watch falls back to reading the store rather than answering from a stale copy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from celery_ojs_ml.store import grants as grant_watch
from celery_ojs_ml.store.grants import CLIENT_NAME, GrantBook, GrantWatch
from celery_ojs_ml.store.registry import OJSStore

pytestmark = pytest.mark.integration

KEY = "ojs:{ml}:grants"


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def watch(request: pytest.FixtureRequest, redis_url: str) -> Iterator[GrantWatch]:
    client = redis.Redis.from_url(redis_url, protocol=request.param)
    w = GrantWatch(client, KEY)
    yield w
    w.close()
    client.close()


def test_every_write_is_seen_by_the_next_lookup_without_a_read_per_lookup(
    watch: GrantWatch, redis_client: redis.Redis
) -> None:
    redis_client.hset(KEY, "q|on-demand|c1", "w1\tE1")
    assert watch.lookup("q|on-demand|c1") == (True, "w1\tE1")
    before = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    for _ in range(50):
        assert watch.lookup("q|on-demand|c1") == (True, "w1\tE1")
    after = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    assert after == before  # answered from the copy
    for epoch in range(20):  # a revoke, a new grant, another field: each seen at once
        redis_client.hdel(KEY, "q|on-demand|c1")
        assert watch.lookup("q|on-demand|c1") == (True, None)
        redis_client.hset(KEY, "q|on-demand|c1", f"w2\tE{epoch}")
        assert watch.lookup("q|on-demand|c1") == (True, f"w2\tE{epoch}")
    redis_client.delete(KEY)
    assert watch.lookup("q|on-demand|c1") == (True, None)


def test_a_write_to_another_key_does_not_drop_the_copy(
    watch: GrantWatch, redis_client: redis.Redis
) -> None:
    redis_client.hset(KEY, "f", "w\tE")
    watch.lookup("f")
    before = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    redis_client.set("ojs:{ml}:leases", "1")
    redis_client.hset("ojs:{ml}:class:version", "x", "1")
    assert watch.lookup("f") == (True, "w\tE")
    after = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    assert after == before


def test_a_killed_watch_connection_falls_back_to_the_store_and_never_answers_stale(
    watch: GrantWatch, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grant_watch, "_RETRY_S", 0.0)  # reconnect at the next lookup
    redis_client.hset(KEY, "f", "w\tE1")
    assert watch.lookup("f") == (True, "w\tE1")
    mine = _addr(watch)
    assert _named(redis_client).get(mine) == CLIENT_NAME
    redis_client.client_kill(mine)  # only it: other tests share the server
    redis_client.hset(KEY, "f", "w\tE2")
    known, value = watch.lookup("f")
    assert (known, value) in {(False, None), (True, "w\tE2")}
    store = OJSStore(redis_client)
    book = GrantBook(store)
    book._watch = watch  # the book reads the store while the watch steps aside
    assert book.lookup("f") == ("w", "E2")
    watch.lookup("f")  # connects again: no retry delay here
    redis_client.hset(KEY, "f", "w\tE3")
    assert watch.lookup("f") == (True, "w\tE3")
    named = _named(redis_client)
    assert mine not in named and named.get(_addr(watch)) == CLIENT_NAME


def _addr(watch: GrantWatch) -> str:
    """The watch connection's address as the server lists it (`CLIENT LIST` addr)."""
    host, port = watch._conn._sock.getsockname()[:2]
    return f"{host}:{port}"


def _named(client: redis.Redis) -> dict[str, str]:
    return {c["addr"]: c["name"] for c in client.client_list()}


def test_a_forked_child_opens_its_own_watch(watch: GrantWatch, redis_client: redis.Redis) -> None:
    redis_client.hset(KEY, "f", "w\tE1")
    assert watch.lookup("f") == (True, "w\tE1")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            redis_client.hset(KEY, "f", "w\tE2")
            ok = watch.lookup("f") == (True, "w\tE2")
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert watch.lookup("f") == (True, "w\tE2")  # the parent's watch saw the child's write


def test_a_server_without_key_tracking_leaves_every_lookup_to_the_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="celery_ojs_ml.store.grants")
    client = fakeredis.FakeRedis()
    client.hset(KEY, "f", "w\tE")
    book = GrantBook(OJSStore(client))
    assert book.lookup("f") == ("w", "E")
    client.hdel(KEY, "f")
    assert book.lookup("f") is None
    assert book._watch is not None and book._watch.lookup("f") == (False, None)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [("INFO", said[0][1])]  # told once, not retried with a warning
    assert "publishers read grants per job (no key tracking" in said[0][1]
