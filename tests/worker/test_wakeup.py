"""Waking a Redis consumer's blocked BRPOP when the subscription grows (DESIGN decision 2)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import redis

from celery_ojs_ml.worker.wakeup import wake_consumer


def _blocked(client: redis.Redis) -> Any:
    """A connection of `client`'s pool blocked in BRPOP, as kombu's consumer leaves it."""
    conn = client.connection_pool.get_connection()
    conn.send_command("BRPOP", "ojs-test:nothing", 10)
    deadline = time.monotonic() + 5
    while not any(c.get("cmd") == "brpop" for c in client.client_list()):
        assert time.monotonic() < deadline, "the BRPOP never blocked"
        time.sleep(0.01)
    return conn


def _calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_wake_unblocks_the_consumers_brpop_and_remembers_its_client_id(
    redis_client: redis.Redis,
) -> None:
    consumer = SimpleNamespace(channel=SimpleNamespace(client=redis_client, _in_poll=None))
    assert wake_consumer(consumer) is False, "nothing in flight: nothing to unblock"
    conn = _blocked(redis_client)
    consumer.channel._in_poll = conn
    lists = _calls(redis_client, "client|list")
    t0 = time.monotonic()
    assert wake_consumer(consumer) is True
    assert conn.read_response() is None  # BRPOP returned nil at once, not after 10 s
    assert time.monotonic() - t0 < 5
    assert _calls(redis_client, "client|list") == lists + 1

    conn.send_command("BRPOP", "ojs-test:nothing", 10)
    deadline = time.monotonic() + 5
    while not any(c.get("cmd") == "brpop" for c in redis_client.client_list()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lists = _calls(redis_client, "client|list")
    assert wake_consumer(consumer) is True
    assert conn.read_response() is None
    assert _calls(redis_client, "client|list") == lists, "the second wake-up needs no CLIENT LIST"
    redis_client.connection_pool.release(conn)
