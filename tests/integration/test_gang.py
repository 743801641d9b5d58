"""Gang placement (Flux RFC 25 node>slot) on real workers: a 2-rank torch gloo all-reduce.

Three workers; one is full. `ml.gang(sig, 2)` places both ranks at once on
two distinct free workers, each rank gets torch.distributed's `env://`
rendezvous (MASTER_ADDR of rank 0's worker, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK), and the all-reduce of 1 + 2 gives 3 on both ranks. A gang that
cannot be placed whole starts no rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import EventLog, WorkerProcess, running

pytestmark = pytest.mark.integration
pytest.importorskip("torch")

CONF = json.dumps({"ojs_ml_advertise_address": "127.0.0.1"})
ENV = {"OJS_TEST_CONF": CONF, "GLOO_SOCKET_IFNAME": "lo"}


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def test_a_two_rank_gang_runs_at_once_on_distinct_workers_and_all_reduces_the_right_sum(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url, ojs_ml_advertise_address="127.0.0.1")
    workers = _two_workers(redis_url, tmp_path, ENV)
    with running(workers, store):
        ranks = app.ojs_ml.gang(app.tasks["ml.allreduce"].s(0.2), 2)
        found = ranks.get(timeout=90)
    by_rank = {int(r["env"]["RANK"]): r for r in found}
    assert sorted(by_rank) == [0, 1]
    assert [r["sum"] for r in found] == [3.0, 3.0], "the all-reduce of 1 + 2 is 3 on each rank"
    assert by_rank[0]["worker"] != by_rank[1]["worker"], "two ranks on one worker"
    for r in by_rank.values():
        env = r["env"]
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0", env
        assert env["MASTER_ADDR"] == "127.0.0.1", env
    assert by_rank[0]["env"]["MASTER_PORT"] == by_rank[1]["env"]["MASTER_PORT"]
    app.close()


def test_a_gang_that_cannot_be_placed_whole_starts_no_rank(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """One free worker only: best fit alone would start rank 0 there and leave it waiting."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                           extra_env=ENV)  # fmt: skip
    with running([worker], store):
        ranks = app.ojs_ml.gang(app.tasks["ml.allreduce"].s(), 2)
        ids = [r.id for r in ranks.results]
        book = PendingBook(store)
        deadline = time.monotonic() + 10
        notes: list[str] = []
        while time.monotonic() < deadline:
            notes = [((book.get(i) or {}).get("annotation") or {}).get("reason_pending") or ""
                     for i in ids]  # fmt: skip
            if all(notes):
                break
            time.sleep(0.1)
        time.sleep(1.0)
        assert _results(redis_client) == [], "a rank ran while the other waited"
        assert all("1/2 ranks can be placed now" in n for n in notes), notes
        assert {(book.get(i) or {}).get("state") for i in ids} == {"pending"}
        for i in ids:
            app.ojs_ml.cancel(i)
    app.close()


def test_a_gang_whose_rank_worker_is_sigkilled_is_placed_again_whole_and_resumes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A rank's worker dies mid-training: the other rank fails at its next all-reduce, both
    are re-published, and the gang runs again whole on two live workers from its last
    committed checkpoint; the crash counts once for the gang."""
    store = OJSStore(redis_client, prefix="ojs")
    conf = json.dumps(
        {
            "ojs_ml_advertise_address": "127.0.0.1",
            "ojs_ml_lease_ttl_s": 3,
            "ojs_ml_heartbeat_s": 0.5,
        }
    )
    env = {**ENV, "OJS_TEST_CONF": conf, "OJS_TEST_CKPT": str(tmp_path / "ckpt")}
    app = make_app(redis_url)
    workers = {
        n: WorkerProcess(n, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                         extra_env=env)
        for n in ("a", "b", "c")
    }  # fmt: skip
    with running(list(workers.values()), store):
        ranks = app.ojs_ml.gang(app.tasks["ml.gang_train"].s(12, 0.5), 2)
        first = _wait_runs(redis_client, 2, 30)
        time.sleep(2.5)  # a few epochs committed
        victim = next(r["worker"] for r in first if r["rank"] == 1)
        workers[victim.split("@")[0]].kill()
        found = ranks.get(timeout=120)
        runs = [r for r in _results(redis_client) if r["tag"] == "gang-run"]
    assert [r["sum"] for r in found] == [3.0, 3.0]
    again = [r for r in runs if r["port"] != first[0]["port"]]
    assert len(again) == 2, f"the gang was not placed again whole: {runs}"
    assert len({r["worker"] for r in again}) == 2 and victim not in {r["worker"] for r in again}
    assert all(r["start_epoch"] > 0 for r in again), "it did not resume from its checkpoint"
    assert {r["crashes"] for r in again} == {1}, "the crash counted more than once"
    app.close()


def test_when_a_rank_fails_first_its_peers_are_stopped_and_the_gang_is_placed_again_at_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Rank 0 fails before the rendezvous; rank 1 would block 300 s (torch's gloo waits 30
    minutes by default). The first rank to fail asks rank 1's worker to stop it
    (`ojs_ml_stop_rank`), so the gang is placed again whole within seconds, the crash
    counted once."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = _two_workers(redis_url, tmp_path, ENV, "-E")
    events = EventLog(app, ("task-retried",), lambda seen: len(seen) >= 2)
    with running(workers, store), events:
        t0 = time.time()
        ranks = app.ojs_ml.gang(app.tasks["ml.gang_stuck"].s(300.0), 2)
        found = ranks.get(timeout=60)  # far below the 300 s the stuck rank would hold
        took = time.time() - t0
        logs = "".join(w.output() for w in workers)
    retried = {e["uuid"]: e["exception"] for e in events.events}
    assert sorted(retried) == sorted(r.id for r in ranks.results), "Flower sees both retried"
    assert all(x.startswith("GangReplaced(") for x in retried.values()), retried
    runs = [r for r in _results(redis_client) if r["tag"] == "gang-stuck"]
    assert sorted((r["rank"], r["crashes"]) for r in found) == [(0, 1), (1, 1)], found
    first = sorted((r["rank"], r["crashes"]) for r in runs if r["crashes"] == 0)
    # rank 1 may be stopped before its body records (the stop can beat its child's start)
    assert first in ([(0, 0), (1, 0)], [(0, 0)]), f"the first placement ran once: {runs}"
    assert "stopping gang rank" in logs, logs[-3000:]
    assert took < 60, took
    app.close()


def test_a_gang_past_its_crash_limit_fails_every_rank_at_once_with_the_reason(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_max_crashes` 0: rank 0's failure ends the gang. Rank 1, which would block
    300 s, is stopped too and fails with a reason that names the limit, not REVOKED."""
    store = OJSStore(redis_client, prefix="ojs")
    conf = json.dumps({"ojs_ml_advertise_address": "127.0.0.1", "ojs_ml_max_crashes": 0})
    env = {**ENV, "OJS_TEST_CONF": conf}
    app = make_app(redis_url)
    workers = _two_workers(redis_url, tmp_path, env, "-E")
    events = EventLog(app, ("task-failed",), lambda seen: len(seen) >= 2)
    with running(workers, store), events:
        ranks = app.ojs_ml.gang(app.tasks["ml.gang_stuck"].s(300.0), 2)
        deadline = time.monotonic() + 60  # far below the 300 s the stuck rank would hold
        while not all(r.state == "FAILURE" for r in ranks.results):
            states = [r.state for r in ranks.results]
            assert time.monotonic() < deadline, (states, workers[1].output()[-3000:])
            time.sleep(0.2)
        first, second = (str(r.result) for r in ranks.results)
    assert "could not open its rendezvous" in first, first
    assert "ojs_ml_max_crashes" in second, second
    failed = {e["uuid"]: e["exception"] for e in events.events}
    assert sorted(failed) == sorted(r.id for r in ranks.results), "Flower sees both failed"
    assert "ojs_ml_max_crashes" in failed[ranks.results[1].id], failed
    runs = [r for r in _results(redis_client) if r["tag"] == "gang-stuck"]
    placed = sorted(r["rank"] for r in runs)  # rank 1 may be stopped before its body records
    assert placed in ([0, 1], [0]), f"placed once only: {runs}"
    app.close()


def _two_workers(
    redis_url: str, tmp_path: Path, env: dict[str, str], *args: str
) -> list[WorkerProcess]:
    """Workers a and b, each an A100x2 with two processes."""
    return [
        WorkerProcess(n, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env=env, extra_args=args)
        for n in ("a", "b")
    ]  # fmt: skip


def _wait_runs(client: redis.Redis, n: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [r for r in _results(client) if r["tag"] == "gang-run"]
        if len(runs) >= n:
            return runs
        time.sleep(0.1)
    raise AssertionError("the gang never started")
