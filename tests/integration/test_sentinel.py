"""The store behind Redis Sentinel: a real worker follows a failover of its primary.

Real processes on loopback (`tests/integration/sentinel.py`): a primary, its replica and
three sentinels for the store, and a plain redis-server as the broker (not under test).
The failover is the one a dead host causes: the primary is SIGKILLed and the sentinels
promote the replica. A failover with asynchronous replication can also lose the last
writes; the last test takes them away from the store by hand, as such a failover would.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.errors import StoreUnavailable
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import ASSIGNED, STARTED, PendingBook
from celery_ojs_ml.store.pending_records import job_key
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.sentinel import SentinelSetup, sentinel_setup
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

_DEADLINE_S = 120.0


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    with sentinel_setup(tmp_path / "sentinel") as setup:
        yield setup


def _wait(what: str, check: Callable[[], Any], timeout: float = _DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except redis.RedisError:  # the store is between primaries
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _store(setup: SentinelSetup) -> OJSStore:
    return OJSStore.from_url(setup.url, options=setup.options)


def _worker(setup: SentinelSetup, broker: str, tmp_path: Path, **conf: Any) -> WorkerProcess:
    settings = {"ojs_ml_store_transport_options": setup.options, **conf}
    env = {
        "OJS_TEST_STORE": setup.url,
        "OJS_TEST_CONF": json.dumps(settings),
        "OJS_TEST_CKPT": str(tmp_path / "ckpt"),
    }
    return WorkerProcess(
        "sentinel", broker, "profile:nvidia-a100x2", tmp_path, concurrency=2, extra_env=env
    )


def _completed(client: redis.Redis) -> Counter[str]:
    return Counter(json.loads(raw)["tag"] for raw in client.lrange(RESULTS_KEY, 0, -1))


def test_a_sentinel_store_reads_its_records_back_from_the_promoted_replica(
    sentinels: SentinelSetup,
) -> None:
    store = _store(sentinels)
    leases = LeaseBook(store, ttl_s=30)
    store.advertise("w@host", {"gpu": 1}, {"gpu_count": 1}, ttl_s=60)
    token = leases.take({"task_id": "job-1", "worker": "w@host"})
    assert store.replicated() is None  # off by default
    store.replicas = 1
    assert store.replicated() == 1  # the replica holds every write so far

    sentinels.primary.kill()
    assert sentinels.wait_failover() == sentinels.replica.port

    assert _wait("the new primary", lambda: "w@host" in store.live_workers(), 30)
    assert leases.refresh({"job-1": token}) == ([], [])
    assert store.replicated() == 0  # no replica left: WAIT returns short instead of hanging
    store.close()


@pytest.mark.timeout(360)
@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["no-wait", "wait-for-a-replica"])
def test_a_worker_runs_every_job_exactly_once_across_a_failover_of_its_store(
    sentinels: SentinelSetup,
    redis_url: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    wait_replicas: int,
) -> None:
    store = _store(sentinels)
    worker = _worker(sentinels, redis_url, tmp_path, ojs_ml_store_wait_replicas=wait_replicas)
    app = make_app(redis_url, ojs_ml_store_url=sentinels.url)
    app.conf.ojs_ml_store_transport_options = sentinels.options
    record = app.tasks["ml.record"]
    sent: list[str] = []

    def publish(tag: str, sleep_s: float) -> None:
        try:
            record.apply_async(args=[tag, sleep_s], kwargs={"cuda": False})
            sent.append(tag)
        except StoreUnavailable:  # refused whole, as the docs say: nothing was published
            pass

    with running([worker], store):
        for n in range(4):  # two run on the two GPUs, two wait in the pending set
            publish(f"before-{n}", 3.0)
        leases = LeaseBook(store, ttl_s=30)
        _wait("two running jobs", lambda: len(leases.all()) == 2)

        sentinels.primary.kill()
        for n in range(2):
            publish(f"during-{n}", 0.5)
        sentinels.wait_failover()
        for n in range(2):
            publish(f"after-{n}", 0.5)

        _wait("every job published", lambda: set(_completed(redis_client)) >= set(sent))
        _wait("the worker on the new primary", lambda: worker.hostname in store.live_workers())
        time.sleep(2.0)  # a second run of any job would land meanwhile
        assert worker.proc is not None and worker.proc.poll() is None
        log = worker.output()
    app.close()

    assert {tag for tag in sent if tag.startswith("before")} == {f"before-{n}" for n in range(4)}
    assert {tag for tag in sent if tag.startswith("after")} == {"after-0", "after-1"}
    assert _completed(redis_client) == Counter(dict.fromkeys(sent, 1))
    assert "stopping this copy" not in log and "running it again" not in log
    assert _wait("every lease released", lambda: LeaseBook(store, ttl_s=30).all() == [], 30)
    store.close()


@pytest.mark.timeout(300)
def test_a_worker_writes_back_a_start_and_a_lease_the_promoted_replica_never_got(
    sentinels: SentinelSetup, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = _store(sentinels)
    book = PendingBook(store)
    worker = _worker(sentinels, redis_url, tmp_path, ojs_ml_assignment_timeout_s=4.0)
    app = make_app(redis_url, ojs_ml_store_url=sentinels.url)
    app.conf.ojs_ml_store_transport_options = sentinels.options
    runs = "ojs-test:runs:"

    with running([worker], store):
        job = app.tasks["ml.ckpt_train"].apply_async(args=[16, 0.5])
        leases = LeaseBook(store, ttl_s=30)
        lease = _wait("the lease", lambda: leases.get(job.id))
        record = book.get(job.id)
        assert record is not None and record["state"] == STARTED
        # The last writes never reached the replica: the store holds the job as the
        # leader assigned it (not started, assigned just now), and no lease at all.
        with store.client.pipeline(transaction=True) as pipe:
            key = job_key(store, job.id)
            pipe.hset(key, mapping={"state": ASSIGNED, "assigned_at": repr(time.time())})
            pipe.persist(key)
            pipe.zadd(book.index_key, {job.id: 0.0})
            pipe.delete(store.lease_key(job.id))
            pipe.zrem(store.key("leases"), job.id)
            pipe.execute()

        rewritten = _wait("the lease written again", lambda: leases.get(job.id))
        assert rewritten["token"] == lease["token"]
        assert _wait("the start written again", lambda: book.get(job.id)["state"] == STARTED)
        _wait("the job to end", lambda: redis_client.get(f"ojs-test:done:{job.id}"), 90)
        time.sleep(1.0)
        log = worker.output()
    app.close()

    assert redis_client.llen(runs + job.id) == 1  # one run, never taken back and placed again
    assert "the start of" in log and "had vanished from the store too" in log
    store.close()
