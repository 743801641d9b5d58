"""LeaseBook on a real Redis (DESIGN decision 4), through Lua and through the fallback.

The fallback (MULTI pipeline and WATCH compare-and-set) is what runs on servers
without scripting, such as fakeredis in the embedded demo.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
import redis

from celery_ojs_ml.integration.leases import LeaseBook
from celery_ojs_ml.store import OJSStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["lua", "multi"])
def book(request: pytest.FixtureRequest, redis_client: redis.Redis) -> tuple[LeaseBook, Clock]:
    clock = Clock()
    leases = LeaseBook(OJSStore(redis_client, prefix="lt", clock=clock), ttl_s=30)
    if request.param == "multi":
        leases._scripts = None
    return leases, clock


def _record(task_id: str = "job-1", worker: str = "a@x") -> dict[str, Any]:
    return {"task_id": task_id, "worker": worker, "incarnation": "i1", "devices": [0]}


def test_take_writes_the_lease_and_its_deadline(book: tuple[LeaseBook, Clock]) -> None:
    leases, clock = book
    token = leases.take(_record())
    lease = leases.get("job-1")
    assert lease is not None and lease["token"] == token and lease["deadline"] == 1030.0
    assert leases.expired() == []
    clock.now = 1031.0
    assert leases.expired() == ["job-1"]


def test_release_deletes_only_a_lease_that_is_still_ours(book: tuple[LeaseBook, Clock]) -> None:
    leases, _ = book
    old = leases.take(_record())
    new = leases.take(_record(worker="b@x"))  # re-published and started elsewhere
    assert leases.release("job-1", old) is False
    assert leases.get("job-1") is not None and leases.get("job-1")["token"] == new  # type: ignore[index]
    assert leases.release("job-1", new) is True
    assert leases.get("job-1") is None and leases.all() == []
    assert leases.release("job-1", new) is False


def test_an_expired_lease_is_claimed_by_exactly_one_worker(book: tuple[LeaseBook, Clock]) -> None:
    leases, clock = book
    leases.take(_record())
    clock.now = 1100.0
    first = leases.claim("job-1", "b@x", "i2")
    second = leases.claim("job-1", "c@x", "i3")
    assert first is not None and first["worker"] == "a@x"
    assert second is None


def test_without_scripting_the_book_falls_back_by_itself() -> None:
    client = fakeredis.FakeRedis()
    leases = LeaseBook(OJSStore(client, prefix="lt"), ttl_s=30)
    token = leases.take(_record())
    assert leases._scripts is None, "fakeredis has no Lua here: the fallback ran"
    assert leases.get("job-1") is not None
    assert leases.release("job-1", token) is True
    assert leases.get("job-1") is None
