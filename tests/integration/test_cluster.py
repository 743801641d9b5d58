"""The store's records on a real three-primary Redis Cluster, and where the store stops.

Every key is `<prefix>:{ml}:...`, so all of them hash to one slot, on one primary: the
worker's and the producer's record operations (advertisement, admission, the gate's
start, leases, checkpoint commits) run there unchanged through redis-py's
`RedisCluster`. The leader's operations do not: its pipelined scripts and its WATCH
transactions are refused by redis-py's cluster pipeline, which is why the store URL
cannot be a cluster (docs/operations.md, "Redis Cluster"). These tests pin both facts.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from celery_ojs_ml.checkpoint import CheckpointMeta, records
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import ASSIGNED, STARTED, PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import free_port, stop_process

pytestmark = pytest.mark.integration

_NODES = 3
_START_TIMEOUT_S = 30.0


def _start_node(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is a test prerequisite (apt-get install redis-server)"
    folder = workdir / str(port)
    folder.mkdir()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
    argv += ["--cluster-port", str(free_port())]  # the bus: not port + 10000, maybe taken
    argv += ["--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"]
    argv += ["--daemonize", "no", "--dir", str(folder)]
    with (folder / "redis.log").open("wb") as out:
        return subprocess.Popen(argv, cwd=folder, stdout=out, stderr=subprocess.STDOUT)


def _wait_cluster_ok(port: int) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    with redis.Redis(port=port, socket_timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                if client.cluster("info").get("cluster_state") == "ok":
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"the cluster did not reach state ok in {_START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Three primaries (no replicas) sharing the 16384 slots; their ports."""
    cli = shutil.which("redis-cli")
    assert cli, "redis-cli is a test prerequisite (apt-get install redis-server)"
    workdir = tmp_path_factory.mktemp("cluster")
    ports = [free_port() for _ in range(_NODES)]
    procs = [_start_node(workdir, port) for port in ports]
    try:
        for port in ports:
            _wait_ping(port)
        nodes = [f"127.0.0.1:{port}" for port in ports]
        create = [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        _wait_cluster_ok(ports[0])
        yield ports
    finally:
        for proc in procs:
            stop_process(proc)


def _wait_ping(port: int) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    with redis.Redis(port=port, socket_timeout=1) as client:
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, f"redis-server on {port} did not start"
                time.sleep(0.05)


@pytest.fixture
def store(cluster: list[int]) -> Iterator[OJSStore]:
    client = RedisCluster(host="127.0.0.1", port=cluster[0], socket_timeout=5)
    yield OJSStore(client, prefix=f"c{uuid.uuid4().hex[:6]}")
    client.close()


def _holders(ports: list[int], store: OJSStore) -> list[int]:
    """The primaries that hold any of the store's keys."""
    found = []
    for port in ports:
        with redis.Redis(port=port) as node:
            if any(True for _ in node.scan_iter(match=store.key("*"), count=1000)):
                found.append(port)
    return found


def test_the_workers_and_producers_records_run_on_a_cluster_in_one_slot(
    cluster: list[int], store: OJSStore
) -> None:
    store.advertise("w@host", {"gpu": 1}, {"gpu_count": 1}, ttl_s=30, held=[{"task_id": "j"}])
    store.set_pending("job-0", {"reason": "waiting", "queue": "train"})
    assert list(store.live_workers()) == ["w@host"]
    assert store.held() == {"w@host": [{"task_id": "j"}]}
    assert store.pending()["job-0"]["queue"] == "train"

    assert len(_holders(cluster, store)) == 1  # every key on the primary of the {ml} slot


def test_admission_a_single_assignment_and_the_gates_start_run_on_a_cluster(
    store: OJSStore,
) -> None:
    book = PendingBook(store)
    msg = {"headers": {"ojs_msg": "m-1"}, "body": ""}

    assert book.admit_many([("job-1", {"submitted_at": 1.0}, msg)]) == [True]
    assert book.admit_many([("job-1", {"submitted_at": 1.0}, msg)]) == [False]  # seen
    token = book.assign("job-1", "w@host", now=time.time())
    assert token is not None and book.get("job-1")["state"] == ASSIGNED  # type: ignore[index]
    assert book.start("job-1", token, "w@host") == "ok"
    assert book.start("job-1", "stale-token", "w@host") == "stale"
    assert book.get("job-1")["state"] == STARTED  # type: ignore[index]


def test_leases_and_checkpoint_commits_run_on_a_cluster(store: OJSStore) -> None:
    leases = LeaseBook(store, ttl_s=30)
    leases.load_scripts()
    token = leases.take({"task_id": "job-2", "worker": "w@host", "incarnation": "a"})
    assert leases.refresh({"job-2": token}) == ([], [])
    assert [lease["task_id"] for lease in leases.all()] == ["job-2"]
    claimed = leases.claim("job-2", "w@host", "b", stale_owner="w@host")
    assert claimed is not None
    assert leases.refresh({"job-2": token}) == (["job-2"], [])  # the old token is fenced
    assert leases.release("job-2", claimed["claim_token"]) is True

    meta = CheckpointMeta(job_id="job-2", epoch=1, sequence=1, storage_key="file:///c/1/")
    records.commit(store, meta, max_count=2, lease_token=None)
    assert records.last_checkpoint(store, "job-2") == meta


def test_the_leaders_pipelined_scripts_and_watch_transactions_are_refused_on_a_cluster(
    store: OJSStore,
) -> None:
    book = PendingBook(store)
    book.admit_many([("job-3", {"submitted_at": 1.0}, {"headers": {}, "body": ""})])

    with pytest.raises(redis.exceptions.RedisClusterException, match="evalsha is blocked"):
        book.assign_many([("job-3", "w@host", "tok", None)], time.time())
    assert book.lead("candidate", 5.0) is True  # taking the lock is one SET NX
    with pytest.raises(AttributeError, match="explicit_transaction"):
        book.lead("candidate", 5.0)  # renewing it is a WATCH transaction
    with pytest.raises(AttributeError, match="explicit_transaction"):
        book.cancel("job-3")
