"""Kill test (DESIGN decision 4, invariant 5): jobs survive SIGKILLed workers.

Two real prefork workers on a private Redis run checkpointing jobs while the
test SIGKILLs whole workers (main process and pool children, as when a node
dies) at random and restarts them. Leases bring every job back: each one
completes, never runs on two workers at the same time, and each re-run starts
from the epoch after its last committed checkpoint. Each job's last save is final
(`save(final=True)`), so a kill between that commit and Celery storing the result
does not run the body again: the recorded result is stored instead
(`worker.finished`), and no job completes twice.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration

JOBS = int(os.environ.get("OJS_KILL_JOBS", "20"))
EPOCHS = 6
KILLS = int(os.environ.get("OJS_KILL_COUNT", "30"))
"""A longer stress run: `OJS_KILL_JOBS=60 OJS_KILL_COUNT=120 pytest <this file>`."""


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "OJS_TEST_CKPT": str(tmp_path / "ckpt"),
        "OJS_TEST_LEASE_TTL": "2",
        "OJS_TEST_VISIBILITY": "5",
        "OJS_TEST_MUTEX_EXPIRE": "5",
        "OJS_TEST_MAX_CRASHES": "100",
    }


@pytest.mark.timeout(240 + 4 * KILLS)
def test_jobs_survive_thirty_random_worker_kills(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = {
        name: WorkerProcess(
            name, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2, extra_env=env
        )
        for name in ("a", "b")
    }
    rng = random.Random(1234)
    try:
        for w in workers.values():
            w.start()
        for w in workers.values():
            w.wait_live(store)
        train = app.tasks["ml.ckpt_train"]
        ids = [
            train.apply_async(args=[EPOCHS, 0.25], kwargs={"final": True}).id for _ in range(JOBS)
        ]
        kills = 0
        while kills < KILLS:
            time.sleep(rng.uniform(0.3, 1.2))
            busy = _busy(store, workers, ids)
            victim = workers[rng.choice(busy or sorted(workers))]
            victim.kill()
            kills += 1
            victim.start()
        logs = [w.log for w in workers.values()]
        lost = _wait_done(redis_client, ids, logs, timeout=150 + 3 * JOBS)
    finally:
        for w in workers.values():
            w.stop()
    app.close()
    assert kills >= KILLS

    # Every job completed: none is lost, not even in kombu's BRPOP window (see `_wait_done`),
    # which the Redis intake (`store.broker`) closes for the intake queue.
    logs = [w.log for w in workers.values()]
    details = {i: _state(redis_client, i, logs) for i in lost}  # for whoever debugs a failure
    assert not lost, f"{len(lost)} jobs lost: {details}"
    restarted = settled = 0
    for task_id in (i for i in ids if i not in lost):
        runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:runs:{task_id}", 0, -1)]
        restarted += len(runs) > 1
        # Completed once, with its result stored. A kill after the final commit leaves the
        # body's own completion mark unwritten (done 0): the recorded result stands for it,
        # and no run ever starts after the final checkpoint.
        done = int(redis_client.get(f"ojs-test:done:{task_id}") or 0)
        finished = [r for r in runs if r.get("done")]
        assert done == len(finished) <= 1, (task_id, done, runs)
        assert _result(redis_client, task_id) == ("SUCCESS", EPOCHS), (task_id, runs)
        assert all(r["start_epoch"] < EPOCHS for r in runs), ("ran after its final", runs)
        settled += done == 0
        # Every (re)run started right after the last committed checkpoint.
        for run in runs:
            expected = 0 if run["committed_epoch"] is None else run["committed_epoch"] + 1
            assert run["start_epoch"] == expected, (task_id, runs)
        # Never on two workers at the same time.
        spans = sorted((r["t0"], r.get("t1", r["t0"])) for r in runs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, (task_id, runs)
        assert runs[-1].get("done") is True or done == 0, (task_id, runs)
    assert restarted > 0, "no job was ever interrupted: the kills did not exercise recovery"
    print(f"kills={kills} re-run after a kill={restarted} settled by the final record={settled}")


def _busy(store: OJSStore, workers: dict[str, WorkerProcess], ids: list[str]) -> list[str]:
    """The workers whose heartbeat shows one of `ids` on a device, waiting up to 2 s for one.

    Kills aim at a worker running a job, so that they interrupt jobs however slowly the
    restarted workers come back (on a loaded machine a worker killed every second or
    so, at random, may never get to run anything while the kills go on); the victim is
    still drawn at random among them, and while no job runs anywhere, among all."""
    wanted = set(ids)
    deadline = time.monotonic() + 2.0
    while True:
        live = store.live_workers()
        busy = [
            name
            for name, w in sorted(workers.items())
            if wanted
            & set(((live.get(w.hostname) or {}).get("free") or {}).get("devices", {}).values())
        ]
        if busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.05)


def _wait_done(client: redis.Redis, ids: list[str], logs: list[Path], timeout: float) -> list[str]:
    """Wait until every job completed; returns the jobs lost before any worker received them.

    kombu's Redis transport pops a message with BRPOP and only then records it
    as unacked (`QoS.append`); a process killed in that instant would lose the
    message before Celery or the plugin ever sees it, as in plain Celery. The
    leader reads the intake through `store.broker` instead, and a
    worker queue's loss is taken back by the scheduler, so none should be lost.
    A job that looks lost (`_nowhere`) for `settle` seconds is returned (and
    fails the test); any other missing job fails it with the state it was in.
    """
    settle = 15.0
    deadline = time.monotonic() + timeout
    lost_since: float | None = None
    missing: list[str] = ids
    while time.monotonic() < deadline:
        missing = [i for i in ids if _result(client, i) is None]
        if not missing:
            return []
        if all(_nowhere(client, i, logs) for i in missing):
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > settle:
                return missing
        else:
            lost_since = None
        time.sleep(0.2)
    details = {i: _state(client, i, logs) for i in missing}
    raise AssertionError(f"{len(missing)} jobs never completed: {details}")


def _result(client: redis.Redis, task_id: str) -> tuple[str, Any] | None:
    """The job's (state, result) in the result backend once it ended, else None."""
    raw = client.get(f"celery-task-meta-{task_id}")
    meta = json.loads(raw) if raw else {}
    return (meta["status"], meta.get("result")) if meta.get("status") == "SUCCESS" else None


def _state(client: redis.Redis, task_id: str, logs: list[Path]) -> dict[str, Any]:
    queued = [
        k
        for pattern in ("celery*", "ojs.ml.*")  # Celery's queues, the intake, workers' own
        for k in client.keys(pattern)
        if client.type(k) == b"list" and any(task_id.encode() in m for m in client.lrange(k, 0, -1))
    ]
    state = client.hget(OJSStore(client, prefix="ojs").key("pjob", task_id), "state")
    return {
        "pending": (state or b"").decode() in ('"pending"', '"assigned"', "pending", "assigned"),
        "runs": [json.loads(r) for r in client.lrange(f"ojs-test:runs:{task_id}", 0, -1)],
        "lease": client.get(OJSStore(client, prefix="ojs").key("lease", task_id)),
        "unacked": [t for t, raw in client.hgetall("unacked").items() if task_id.encode() in raw],
        "queued": queued,
        "logged": any(task_id in log.read_text(errors="replace") for log in logs),
    }


def _nowhere(client: redis.Redis, task_id: str, logs: list[Path]) -> bool:
    """Whether the job's last publish was lost in kombu's BRPOP window (see `_wait_done`).

    The job is in no queue (Celery's, the intake or a worker's own), not unacked,
    not waiting or assigned in the pending set, and has no lease, and either it never
    ran and no worker ever named it, or its last copy was re-published (the
    log's `re-publishing ...[id] ... (crash N)`) and then never received by any
    worker: no run with crash N exists and no `[id] received` line follows.
    """
    state = _state(client, task_id, logs)
    if any(state[k] for k in ("lease", "unacked", "queued", "pending")):  # the store holds it
        return False
    runs = state["runs"]
    if not runs:
        return not state["logged"]
    if any(r.get("done") for r in runs):
        return False
    lines = [line for log in logs for line in log.read_text(errors="replace").splitlines()]
    republished = [
        (_stamp(line), int(m.group(1)))
        for line in lines
        if (m := re.search(rf"re-publishing \S+\[{task_id}\]: .* \(crash (\d+)\)", line))
    ]
    if not republished or any(t is None for t, _ in republished):
        return False
    last_at, crash = max(republished)
    received = [_stamp(line) for line in lines if f"[{task_id}] received" in line]
    return max(r["crashes"] for r in runs) < crash and all(
        t is not None and t < last_at for t in received
    )


def _stamp(line: str) -> datetime | None:
    """The timestamp of a Celery log line, `[2026-11-21 23:20:01,123: ...`."""
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None
