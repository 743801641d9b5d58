"""OJSStore against the session's private redis-server (and once against fakeredis)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.store.registry import OJSStore, class_routes

A100 = {"ext_ml_gpu_count": 1, "ext_ml_gpu_type": "nvidia-a100"}
CAPS = {"capabilities": {"gpu": {"type": "nvidia-a100", "count": 4}}}
FREE = {"gpu_count": 4}


def _eventually(probe: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.02)
    return probe()


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_the_store_answers_ping_on_the_private_server(store: OJSStore) -> None:
    assert store.ping() is True


def test_a_store_on_an_unreachable_server_says_so_instead_of_raising() -> None:
    no_retry = Retry(NoBackoff(), retries=0)
    dead = OJSStore(redis.Redis(port=_closed_port(), socket_connect_timeout=0.2, retry=no_retry))
    try:
        assert dead.ping() is False
    finally:
        dead.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_from_url_reaches_the_server_at_that_url(redis_url: str) -> None:
    store = OJSStore.from_url(redis_url, prefix="fromurl")
    try:
        assert store.ping() is True
    finally:
        store.close()


def _old_registry_entry(
    client: redis.Redis, store: OJSStore, cid: str, queues: list[str], routes: list[list[str]]
) -> None:
    """A class entry as a producer of an earlier version wrote it."""
    client.hset(store.key("class", "constraints"), cid, json.dumps(A100))
    client.sadd(store.key("class", "queues", cid), *queues)
    for route in routes:
        client.sadd(store.key("class", "routes", cid), json.dumps(route))


def test_the_class_registry_of_an_earlier_version_is_still_read(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """`explain` finds jobs left in the per-class queues of an earlier version through it."""
    assert store.classes() == {}
    _old_registry_entry(redis_client, store, "c1", ["train", "infer"], [["train", "spot"]])
    entry = store.classes()["c1"]
    assert entry == {
        "constraints": A100,
        "queues": ["infer", "train"],
        "routes": [["train", "spot"]],
    }
    assert class_routes(entry) == [("train", "spot")] + [("infer", b) for b in BANDS]


def _prefix(store: OJSStore) -> str:
    return store.key().removesuffix(":{ml}")


def test_an_advertised_worker_is_live_with_its_payload(store: OJSStore) -> None:
    store.advertise("w1@host", CAPS, FREE, info={"pool": "prefork"})
    live = store.live_workers()
    assert list(live) == ["w1@host"]
    assert live["w1@host"]["capabilities"] == CAPS
    assert live["w1@host"]["free"] == FREE
    assert live["w1@host"]["info"] == {"pool": "prefork"}
    assert live["w1@host"]["ts"] == pytest.approx(time.time(), abs=5)


def test_a_worker_whose_heartbeat_expires_disappears_from_the_live_registry(
    store: OJSStore,
) -> None:
    store.advertise("w1", CAPS, FREE, ttl_s=0.3)
    store.advertise("w2", CAPS, FREE, ttl_s=30)
    assert set(store.live_workers()) == {"w1", "w2"}
    assert _eventually(lambda: set(store.live_workers()) == {"w2"})


def test_a_refreshed_heartbeat_replaces_the_free_capacity(store: OJSStore) -> None:
    store.advertise("w1", CAPS, {"gpu_count": 4})
    store.advertise("w1", CAPS, {"gpu_count": 1})
    assert store.live_workers()["w1"]["free"] == {"gpu_count": 1}


def test_a_forgotten_worker_is_gone_at_once(store: OJSStore, redis_client: redis.Redis) -> None:
    store.advertise("w1", CAPS, FREE)
    store.forget_worker("w1")
    assert store.live_workers() == {}
    assert redis_client.zcard(store.key("index", "worker")) == 0


def test_listing_workers_prunes_index_entries_long_past_their_expiry(
    redis_client: redis.Redis,
) -> None:
    clock = _Clock()
    store = OJSStore(redis_client, prefix="pruned", clock=clock)
    store.advertise("w1", CAPS, FREE, ttl_s=0.2)
    assert _eventually(lambda: store.live_workers() == {})
    assert redis_client.zcard(store.key("index", "worker")) == 1
    clock.now += 120
    assert store.live_workers() == {}
    assert redis_client.zcard(store.key("index", "worker")) == 0


def test_a_non_positive_ttl_is_refused_with_an_example(store: OJSStore) -> None:
    with pytest.raises(ValueError, match=r"ttl_s must be > 0 seconds, e\.g\. ttl_s=10\.0"):
        store.advertise("w1", CAPS, FREE, ttl_s=0)


def test_pending_records_can_be_set_listed_and_cleared(store: OJSStore) -> None:
    record = {"reason": "0/1 workers eligible", "class_id": "c1", "queue": "train", "since": 1.5}
    store.set_pending("t1", record)
    store.set_pending("t2", {"reason": "held", "class_id": "c2", "queue": "train"})
    pending = store.pending()
    assert pending["t1"] == record
    assert pending["t2"]["since"] == pytest.approx(time.time(), abs=5)
    store.clear_pending("t1")
    assert list(store.pending()) == ["t2"]


def test_a_pending_record_expires_after_its_ttl(store: OJSStore) -> None:
    store.set_pending("t1", {"reason": "r", "class_id": "c1", "queue": "q"}, ttl_s=0.3)
    assert _eventually(lambda: store.pending() == {})


def test_held_snapshots_are_listed_per_worker_and_replaced_on_refresh(store: OJSStore) -> None:
    store.set_held("w1", [{"task_id": "t1"}, {"task_id": "t2"}])
    store.set_held("w2", [])
    store.set_held("w1", [{"task_id": "t2"}])
    assert store.held() == {"w1": [{"task_id": "t2"}], "w2": []}


def test_a_held_snapshot_expires_with_its_worker(store: OJSStore) -> None:
    store.set_held("w1", [{"task_id": "t1"}], ttl_s=0.3)
    assert _eventually(lambda: store.held() == {})


def test_every_key_carries_the_ml_hash_tag(store: OJSStore, redis_client: redis.Redis) -> None:
    store.advertise("w1", CAPS, FREE)
    store.set_pending("t1", {"reason": "r", "class_id": "c1", "queue": "train"})
    store.set_held("w1", [])
    base = f"{_prefix(store)}:{{ml}}"
    assert {k.decode() for k in redis_client.keys("*")} == {
        f"{base}:worker:w1",
        f"{base}:index:worker",
        f"{base}:feed:worker",
        f"{base}:pending:t1",
        f"{base}:index:pending",
        f"{base}:held:w1",
        f"{base}:index:held",
    }


def test_payloads_are_json_with_sorted_keys(store: OJSStore, redis_client: redis.Redis) -> None:
    store.set_pending("t1", {"reason": "r", "queue": "q", "class_id": "c"})
    raw = redis_client.get(store.key("pending", "t1"))
    assert raw == b'{"class_id":"c","queue":"q","reason":"r","since":' + raw.split(b'"since":')[1]


def test_the_store_works_on_fakeredis_for_the_embedded_demo() -> None:
    with fakeredis.FakeRedis() as client:
        store = OJSStore(client)
        _old_registry_entry(client, store, "c1", ["train"], [])
        store.advertise("w1", CAPS, FREE)
        store.set_pending("t1", {"reason": "r", "class_id": "c1", "queue": "train"})
        store.set_held("w1", [{"task_id": "t1"}])
        assert store.classes() == {"c1": {"constraints": A100, "queues": ["train"], "routes": []}}
        assert list(store.live_workers()) == ["w1"]
        assert list(store.pending()) == ["t1"]
        assert store.held() == {"w1": [{"task_id": "t1"}]}
        assert store.ping() is True


@pytest.mark.parametrize("lua", [True, False])
def test_live_workers_and_leases_read_the_same_with_and_without_lua(
    redis_client: redis.Redis, lua: bool
) -> None:
    """`OJSStore.indexed` (one Lua round trip) and its fallback give the same registry."""
    store = OJSStore(redis_client, prefix="ojs")
    if not lua:
        store._indexed = None
    store.advertise("w1@host", {"capabilities": {}}, {"gpus": 1}, ttl_s=30)
    store.advertise("w2@host", {"capabilities": {}}, {"gpus": 0}, ttl_s=30)
    redis_client.delete(store.key("worker", "w2@host"))  # expired key, index entry left
    live = store.live_workers()
    assert list(live) == ["w1@host"] and live["w1@host"]["free"] == {"gpus": 1}
    assert store.indexed(store.key("index", "worker"), store.key("worker", "")) == (
        [("w1@host", redis_client.get(store.key("worker", "w1@host")))] if lua else None
    )


def test_a_heartbeat_is_stored_as_sorted_compact_json_with_its_time_last(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    """The heartbeat is written from its content serialised once, with `ts` spliced in:
    the same bytes as serialising the whole record."""
    store.advertise("w1", CAPS, FREE, info={"queues": ["a"], "pid": 7})
    raw = redis_client.get(store.key("worker", "w1"))
    assert raw is not None
    record = json.loads(raw)
    assert raw.decode() == json.dumps(record, sort_keys=True, separators=(",", ":"))
    assert list(record) == ["capabilities", "fed", "free", "info", "ts"]
    assert record["info"] == {"queues": ["a"], "pid": 7}
