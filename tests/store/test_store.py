"""OJSStore against the session's private redis-server (and once against fakeredis)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_ojs_ml.store.registry import OJSStore

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


def _messages(pubsub: Any, quiet_s: float = 0.3) -> list[dict[str, Any]]:
    """Every data message until the channel has been quiet for `quiet_s`."""
    out = []
    while (msg := pubsub.get_message(ignore_subscribe_messages=True, timeout=quiet_s)) is not None:
        out.append(json.loads(msg["data"]))
    return out


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


def test_registering_a_new_class_returns_true_and_lists_it_with_its_queue(store: OJSStore) -> None:
    assert store.register_class("c1", A100, logical_queue="train") is True
    assert store.classes() == {"c1": {"constraints": A100, "queues": ["train"], "routes": []}}


def test_registering_the_same_class_twice_publishes_once_and_returns_false(
    store: OJSStore, redis_client: redis.Redis
) -> None:
    with redis_client.pubsub() as pubsub:
        pubsub.subscribe(store.classes_channel)
        assert pubsub.get_message(timeout=1.0)["type"] == "subscribe"
        assert store.register_class("c1", A100, logical_queue="train") is True
        assert store.register_class("c1", A100, logical_queue="train") is False
        messages = _messages(pubsub)
    assert messages == [{"class_id": "c1", "logical_queue": "train", "band": None, "version": 1}]


def test_the_registry_version_counts_new_class_queue_pairs_only(store: OJSStore) -> None:
    assert store.classes_version() == 0
    store.register_class("c1", A100, logical_queue="train")
    store.register_class("c1", A100, logical_queue="train")
    assert store.classes_version() == 1
    store.register_class("c2", {"ext_ml_gpu_count": 2}, logical_queue="train")
    assert store.classes_version() == 2


def test_each_new_band_of_a_class_is_a_new_route_and_a_new_version(store: OJSStore) -> None:
    """Workers consume only the (logical queue, band) queues jobs were published to."""
    assert store.register_class("c1", A100, logical_queue="train", band="spot") is True
    assert store.register_class("c1", A100, logical_queue="train", band="spot") is False
    assert store.register_class("c1", A100, logical_queue="train", band="reserved") is True
    assert store.register_class("c1", A100, logical_queue="infer", band="spot") is True
    entry = store.classes()["c1"]
    assert entry["queues"] == ["infer", "train"]
    assert entry["routes"] == [["infer", "spot"], ["train", "reserved"], ["train", "spot"]]
    assert store.classes_version() == 3


def test_a_class_used_from_a_second_logical_queue_keeps_both_queues(store: OJSStore) -> None:
    assert store.register_class("c1", A100, logical_queue="train") is True
    assert store.register_class("c1", A100, logical_queue="infer") is True
    assert store.classes()["c1"]["queues"] == ["infer", "train"]
    assert store.classes_version() == 2


def test_concurrent_registrations_of_one_pair_report_new_exactly_once(
    store: OJSStore, redis_url: str
) -> None:
    stores = [OJSStore.from_url(redis_url, prefix=_prefix(store)) for _ in range(8)]
    start = threading.Barrier(len(stores))

    def register(s: OJSStore) -> bool:
        start.wait(timeout=5)
        return s.register_class("c1", A100, logical_queue="train")

    try:
        with ThreadPoolExecutor(max_workers=len(stores)) as pool:
            results = list(pool.map(register, stores))
    finally:
        for s in stores:
            s.close()
    assert results.count(True) == 1
    assert store.classes_version() == 1


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
    store.register_class("c1", A100, logical_queue="train")
    store.advertise("w1", CAPS, FREE)
    store.set_pending("t1", {"reason": "r", "class_id": "c1", "queue": "train"})
    store.set_held("w1", [])
    base = f"{_prefix(store)}:{{ml}}"
    assert {k.decode() for k in redis_client.keys("*")} == {
        f"{base}:class:constraints",
        f"{base}:class:queues:c1",
        f"{base}:class:version",
        f"{base}:worker:w1",
        f"{base}:index:worker",
        f"{base}:pending:t1",
        f"{base}:index:pending",
        f"{base}:held:w1",
        f"{base}:index:held",
    }
    assert store.classes_channel.endswith(":{ml}:classes")


def test_payloads_are_json_with_sorted_keys(store: OJSStore, redis_client: redis.Redis) -> None:
    store.set_pending("t1", {"reason": "r", "queue": "q", "class_id": "c"})
    raw = redis_client.get(store.key("pending", "t1"))
    assert raw == b'{"class_id":"c","queue":"q","reason":"r","since":' + raw.split(b'"since":')[1]


def test_the_store_works_on_fakeredis_for_the_embedded_demo() -> None:
    with fakeredis.FakeRedis() as client, client.pubsub() as pubsub:
        store = OJSStore(client)
        pubsub.subscribe(store.classes_channel)
        assert pubsub.get_message(timeout=1.0)["type"] == "subscribe"
        assert store.register_class("c1", A100, logical_queue="train") is True
        assert store.register_class("c1", A100, logical_queue="train") is False
        assert _messages(pubsub, quiet_s=0.05) == [
            {"class_id": "c1", "logical_queue": "train", "band": None, "version": 1}
        ]
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
