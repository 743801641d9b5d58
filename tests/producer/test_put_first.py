"""A granted job's record travels in its publish's round trip (`celery_internals.put_first`),
on a real Redis through kombu's own Redis transport (checked against kombu 5.7.0)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection  # type: ignore[attr-defined]
from redis.client import Pipeline
from redis.connection import Connection as RedisConnection

from celery_ojs_ml import celery_internals

QUEUE = "q-put-first"


def message(task_id: str) -> dict[str, Any]:
    return {
        "body": "W10=",
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {"id": task_id, "task": "t"},
        "properties": {"delivery_tag": "d", "priority": 0, "body_encoding": "base64"},
    }


@pytest.fixture
def channel(redis_url: str, redis_client: redis.Redis) -> Iterator[Any]:
    assert celery_internals.install_put_first()
    with Connection(redis_url) as conn:  # type: ignore[no-untyped-call]
        yield conn.default_channel
    celery_internals._FIRST.pending = None


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a redis-py connection wrote to its socket (one per round trip)."""
    count: list[int] = []
    original = RedisConnection.send_packed_command

    def counted(self: RedisConnection, command: Any, check_health: bool = True) -> None:
        count.append(1)
        original(self, command, check_health)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(RedisConnection, "send_packed_command", counted)
    return count


def queued_ids(client: redis.Redis) -> list[str]:
    import json

    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(QUEUE, 0, -1)]


def test_kombus_redis_put_hands_its_lpush_to_a_publish_batch(
    channel: Any, redis_client: redis.Redis
) -> None:
    """The protocol `put_first` relies on: `Channel._put(..., _publish_batch=b)` queues
    the LPUSH on `b` and sends nothing. Fails if kombu changes it."""
    batch = celery_internals._Commands()
    channel._put(QUEUE, message("t0"), _publish_batch=batch)
    assert [name for name, _ in batch.commands] == ["lpush"]
    assert batch.commands[0][1][0] == QUEUE
    assert redis_client.llen(QUEUE) == 0


def test_a_record_put_first_lands_before_its_message_in_the_same_round_trip(
    channel: Any, redis_client: redis.Redis, sends: list[int]
) -> None:
    channel._put("warm-up", message("w"))  # the pool's connection is set up (HELLO, ...)
    sends.clear()
    alone: list[str] = []
    celery_internals.put_first(
        "t1", redis_client, lambda pipe: pipe.hset("rec", "t1", "x"), lambda: alone.append("t1")
    )
    channel._put(QUEUE, message("t1"))
    assert alone == []
    assert len(sends) == 1
    assert redis_client.hget("rec", "t1") == b"x"
    assert queued_ids(redis_client) == ["t1"]
    channel._put(QUEUE, message("t2"))  # nothing left for the next publish
    assert redis_client.hlen("rec") == 1
    assert queued_ids(redis_client) == ["t2", "t1"]


def test_a_store_on_another_database_gets_its_record_on_its_own_before_the_publish(
    channel: Any, redis_client: redis.Redis, redis_url: str
) -> None:
    other = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    seen: list[int] = []

    def alone() -> None:
        seen.append(redis_client.llen(QUEUE))  # the message is not out yet
        other.hset("rec", "t1", "x")

    celery_internals.put_first("t1", other, lambda pipe: pipe.hset("rec", "t1", "y"), alone)
    channel._put(QUEUE, message("t1"))
    assert seen == [0]
    assert other.hget("rec", "t1") == b"x"
    assert redis_client.hget("rec", "t1") is None
    assert queued_ids(redis_client) == ["t1"]
    other.flushdb()


def test_commands_left_for_another_message_are_written_on_their_own_first(
    channel: Any, redis_client: redis.Redis
) -> None:
    seen: list[int] = []
    celery_internals.put_first(
        "gone", redis_client, lambda pipe: pipe.hset("rec", "gone", "y"),
        lambda: seen.append(redis_client.llen(QUEUE)),
    )  # fmt: skip
    channel._put(QUEUE, message("t1"))
    assert seen == [0]
    assert redis_client.hget("rec", "gone") is None  # only `alone` ran, before the push
    assert queued_ids(redis_client) == ["t1"]


def test_a_publish_that_fails_keeps_its_commands_for_kombus_retry(
    channel: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Pipeline.execute
    failures = [redis.ConnectionError("connection reset")]

    def execute(self: Pipeline, raise_on_error: bool = True) -> Any:
        if failures:
            raise failures.pop()
        return original(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", execute)
    celery_internals.put_first(
        "t1", redis_client, lambda pipe: pipe.hset("rec", "t1", "x"), lambda: None
    )
    with pytest.raises(redis.ConnectionError):
        channel._put(QUEUE, message("t1"))
    assert redis_client.llen(QUEUE) == 0
    channel._put(QUEUE, message("t1"))  # kombu's retry policy publishes again
    assert redis_client.hget("rec", "t1") == b"x"
    assert queued_ids(redis_client) == ["t1"]


def test_a_failed_record_command_is_logged_and_the_message_still_goes_out(
    channel: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.set("rec", "a string")  # HSET on it fails with WRONGTYPE
    celery_internals.put_first(
        "t1", redis_client, lambda pipe: pipe.hset("rec", "t1", "x"), lambda: None
    )
    channel._put(QUEUE, message("t1"))
    assert queued_ids(redis_client) == ["t1"]
    assert "a command sent ahead of message t1 failed" in caplog.text


def test_commands_that_cannot_be_queued_are_logged_and_the_message_still_goes_out(
    channel: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    def first(pipe: Any) -> None:
        raise TypeError("Object of type bytes is not JSON serializable")

    celery_internals.put_first("t1", redis_client, first, lambda: None)
    channel._put(QUEUE, message("t1"))
    assert queued_ids(redis_client) == ["t1"]
    assert "could not queue the commands for message t1" in caplog.text
