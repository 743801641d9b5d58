"""The elected fleet scheduler (DESIGN decision 9, Flux RFC 27) with real prefork workers.

Each test starts its own workers on the private Redis, publishes real tasks and
reads what ran where from the `ml.record` / `ml.ckpt_train` records. Bounds are
derived from the settings each test sets, never tuned to a run:

* the leader passes at least every `ojs_ml_scheduler_interval_s` (0.5 s) and at once
  when a job arrives or a worker frees devices;
* a reservation's start is the latest end of the time limits (`ext_ml_timeout_seconds`)
  of the jobs that hold the capacity it waits for;
* a job hand-off (assignment -> gate -> pool child) takes well under a second here,
  so each bound carries `SLACK_S` for the scheduler pass plus the hand-off.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import worker_queue_name
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

SLACK_S = 1.5
SPOT = {"ext_ml_priority_class": "spot"}
RESERVED = {"ext_ml_priority_class": "reserved"}


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def _result(client: redis.Redis, task_id: str) -> dict[str, Any] | None:
    found = [r for r in _results(client) if r["task_id"] == task_id]
    assert len(found) <= 1, f"{task_id} ran to completion {len(found)} times"
    return found[0] if found else None


def _runs(client: redis.Redis, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(f"ojs-test:runs:{task_id}", 0, -1)]


def _worker(
    name: str, url: str, profile: str, tmp: Path, *, conc: int = 3, **env: str
) -> WorkerProcess:
    extra = {"OJS_TEST_CKPT": str(tmp / "ckpt"), **env}
    return WorkerProcess(name, url, f"profile:{profile}", tmp, concurrency=conc, extra_env=extra)


def _explain(app: Celery, task_id: str) -> dict[str, Any]:
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
    args = ["explain", task_id, "--json", "--timeout", "0.5"]
    result = CliRunner().invoke(cli, args, obj=obj, catch_exceptions=False)
    return dict(json.loads(result.stdout))


# -- placement -------------------------------------------------------------------------------


def test_a_one_gpu_job_goes_to_the_one_gpu_worker_and_an_eight_gpu_job_then_starts_at_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Best fit across workers: the 1-GPU job never fragments the 8-GPU worker."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    workers = [
        _worker("big", redis_url, "nvidia-a100x8", tmp_path),
        _worker("small", redis_url, "nvidia-a100x1", tmp_path),
    ]
    with running(workers, store):
        for trial in range(4):
            done_small, done_big, sent = _best_fit_trial(record, redis_client, store, trial)
            assert done_small["worker"] == "small@test", (trial, done_small)
            assert done_big["worker"] == "big@test", (trial, done_big)
            assert done_big["start"] - sent <= SLACK_S, "the 8-GPU job waited for the small one"
            assert done_big["start"] < done_small["end"], "it did not wait for the small job"
    app.close()


def _best_fit_trial(
    record: Any, client: redis.Redis, store: OJSStore, trial: int
) -> tuple[dict[str, Any], dict[str, Any], float]:
    # The previous trial's jobs have written their results, but their workers may not have
    # freed their GPUs yet (the task body ends before the gate's release): best fit is
    # about an idle 1-GPU worker, so wait until both report every GPU free.
    _wait(lambda: _all_free(store, {"big@test": 8, "small@test": 1}), 20, "idle workers")
    small = record.apply_async(args=[f"small{trial}", 2.0], headers={"ext_ml_gpu_count": 1}).id
    _wait(lambda: _result(client, small) or _started(store, small), 20, "the 1-GPU job")
    sent = time.time()
    big = record.apply_async(args=[f"big{trial}", 0.1], headers={"ext_ml_gpu_count": 8}).id
    done_big = _wait(lambda: _result(client, big), 20, "the 8-GPU job")
    done_small = _wait(lambda: _result(client, small), 20, "the 1-GPU job")
    return done_small, done_big, sent


def _all_free(store: OJSStore, gpus: dict[str, int]) -> bool:
    """True once each worker's heartbeat shows all of its GPUs free."""
    live = store.live_workers()
    for name, total in gpus.items():
        counts = ((live.get(name) or {}).get("free") or {}).get("free") or {}
        if counts.get("gpu_count") != total:
            return False
    return True


def _started(store: OJSStore, task_id: str) -> bool:
    """True once a worker advertises `task_id` on one of its devices."""
    for view in store.live_workers().values():
        if task_id in (view.get("free", {}).get("devices") or {}).values():
            return True
    return False


# -- starvation and order --------------------------------------------------------------------


def test_a_four_gpu_job_under_a_stream_of_one_gpu_jobs_starts_within_their_time_limit(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Reservation plus backfill (RFC 27, Slurm): the small jobs' limit is 2 s, so once the
    4-GPU job is first in order (the small jobs published before it have started) no new
    small job may start on its GPUs (each would end after the reserved start), and it
    starts at most 2 s (+ slack) after that; from its submission, at most two limits."""
    limit_s = 2
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    small = {"ext_ml_gpu_count": 1, "ext_ml_timeout_seconds": limit_s}
    with running([_worker("four", redis_url, "nvidia-a100x4", tmp_path, conc=6)], store):
        stream: list[str] = []

        def top_up(in_flight: int = 8) -> None:
            done = {r["task_id"] for r in _results(redis_client)}
            while sum(1 for i in stream if i not in done) < in_flight:
                sleep_s = 0.5 + (len(stream) % 3) * 0.5  # 0.5, 1.0, 1.5 s
                stream.append(record.apply_async(args=["s", sleep_s], headers=small).id)

        end = time.monotonic() + 3
        while time.monotonic() < end:  # the stream runs before the large job arrives
            top_up()
            time.sleep(0.1)
        sent = time.time()
        ahead = list(stream)  # published before the 4-GPU job: first in fleet order
        big = record.apply_async(args=["big", 0.5], headers={"ext_ml_gpu_count": 4})
        end = time.monotonic() + 8
        while time.monotonic() < end and _result(redis_client, big.id) is None:
            top_up()
            time.sleep(0.1)
        done = _wait(lambda: _result(redis_client, big.id), 20, "the 4-GPU job")
        _wait(lambda: len(_results(redis_client)) == len(stream) + 1, 30, "the stream to drain")
    starts = {r["task_id"]: r["start"] for r in _results(redis_client)}
    assert all(starts[i] < done["start"] for i in ahead), "a job ahead in order was overtaken"
    first_at = max([sent, *(starts[i] for i in ahead)])  # the 4-GPU job is first from here
    overtook = sorted(
        (round(r["start"] - sent, 2), round(r["end"] - sent, 2), r["devices"])
        for r in _results(redis_client)
        if r["tag"] == "s" and first_at < r["start"] < done["start"]
    )
    gave = [ln for ln in (tmp_path / "four.log").read_text().splitlines() if "back" in ln]
    late = (round(done["start"] - first_at, 2), round(first_at - sent, 2), overtook, gave[-6:])
    assert overtook == [], f"a later 1-GPU job took the reserved GPUs: {late}"
    assert done["start"] - first_at <= limit_s + SLACK_S, late
    assert done["start"] - sent <= 2 * limit_s + SLACK_S, done["start"] - sent
    assert sorted(done["devices"]) == [0, 1, 2, 3]
    overlap = [
        r for r in _results(redis_client) if r["tag"] == "s" and r["start"] < done["end"]
        and r["end"] > done["start"]
    ]  # fmt: skip
    assert overlap == [], "a 1-GPU job ran beside the 4-GPU job on a 4-GPU worker"
    app.close()


def test_a_reserved_job_waiting_fleet_wide_starts_before_every_competing_spot_job(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Order: band first, then priority, then submit time, whatever the submit order."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with running([_worker("one", redis_url, "nvidia-a100x1", tmp_path)], store):
        blocker = record.apply_async(args=["blocker", 2.0], headers={"ext_ml_timeout_seconds": 10})
        _wait(lambda: _started(store, blocker.id), 20, "the blocker to start")
        spots = [record.apply_async(args=[f"spot{i}", 0.2], headers=SPOT).id for i in range(3)]
        reserved = record.apply_async(args=["reserved", 0.2], headers=RESERVED).id
        _wait(lambda: len(_results(redis_client)) == 5, 30, "all five jobs")
    by_id = {r["task_id"]: r for r in _results(redis_client)}
    assert by_id[reserved]["start"] >= by_id[blocker.id]["end"], "no preemption of on-demand"
    assert all(by_id[reserved]["end"] <= by_id[s]["start"] for s in spots), "a spot job overtook"
    spot_starts = [by_id[s]["start"] for s in spots]
    assert spot_starts == sorted(spot_starts), "spot jobs ran out of submit order"
    app.close()


# -- preemption choice -----------------------------------------------------------------------


def test_a_reserved_job_preempts_nothing_when_another_worker_is_free(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = [
        _worker(n, redis_url, "nvidia-a100x1", tmp_path, OJS_TEST_MIN_RUNTIME="0") for n in "ab"
    ]
    with running(workers, store):
        spot = app.tasks["ml.ckpt_train"].apply_async(args=[8, 0.25], headers=SPOT).id
        _wait(lambda: _runs(redis_client, spot), 20, "the spot job to run")
        reserved = app.tasks["ml.record"].apply_async(args=["reserved", 0.2], headers=RESERVED)
        done = _wait(lambda: _result(redis_client, reserved.id), 20, "the reserved job")
        _wait(lambda: redis_client.get(f"ojs-test:done:{spot}"), 30, "the spot job")
    [run] = _runs(redis_client, spot)
    assert run["preemptions"] == 0 and run.get("done"), run
    assert done["worker"] != run["worker"], "it went to the free worker"
    app.close()


def test_a_reserved_job_preempts_the_spot_job_that_loses_the_least_work(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two full 1-GPU workers: an older spot job that checkpoints every 0.25 s loses at most
    0.25 s; a younger one without checkpoints loses all it did. The older one is the victim
    (a youngest-first rule would pick the other)."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = [
        _worker(n, redis_url, "nvidia-a100x1", tmp_path, OJS_TEST_MIN_RUNTIME="0") for n in "ab"
    ]
    with running(workers, store):
        ckpt = app.tasks["ml.ckpt_train"].apply_async(args=[40, 0.25], headers=SPOT).id
        _wait(lambda: (_runs(redis_client, ckpt) or [{}])[0].get("epoch", -1) >= 2, 20, "ckpt")
        plain = app.tasks["ml.record"].apply_async(args=["no-ckpt", 4.0], headers=SPOT).id
        _wait(lambda: _started(store, plain), 20, "the spot job without checkpoints")
        time.sleep(1.0)  # it has 1 s of work to lose; the other at most one epoch
        reserved = app.tasks["ml.record"].apply_async(args=["reserved", 0.2], headers=RESERVED)
        done = _wait(lambda: _result(redis_client, reserved.id), 20, "the reserved job")
        _wait(lambda: redis_client.get(f"ojs-test:done:{ckpt}"), 60, "the spot job to resume")
        no_ckpt = _wait(lambda: _result(redis_client, plain), 20, "the other spot job")
    first = _runs(redis_client, ckpt)[0]
    assert len(_runs(redis_client, ckpt)) == 2, "the checkpointing job was preempted once"
    assert done["worker"] == first["worker"]
    assert no_ckpt["start"] < done["start"], "the job without checkpoints ran on, unpreempted"
    app.close()


def test_a_reserved_job_does_not_preempt_a_victim_younger_than_the_minimum_runtime(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_min_runtime_before_preemption_s` = 3: the reserved job arrives 0.3 s after the
    spot job started and gets the GPU only once the victim has run 3 s."""
    min_runtime = 3.0
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = _worker("one", redis_url, "nvidia-a100x1", tmp_path, OJS_TEST_MIN_RUNTIME="3")
    with running([worker], store):
        spot = app.tasks["ml.ckpt_train"].apply_async(args=[30, 0.25], headers=SPOT).id
        _wait(lambda: _runs(redis_client, spot), 20, "the spot job to run")
        time.sleep(0.3)
        reserved = app.tasks["ml.record"].apply_async(args=["reserved", 0.2], headers=RESERVED)
        done = _wait(lambda: _result(redis_client, reserved.id), 20, "the reserved job")
        _wait(lambda: redis_client.get(f"ojs-test:done:{spot}"), 60, "the spot job to resume")
    first = _runs(redis_client, spot)[0]
    assert done["start"] - first["t0"] >= min_runtime, done["start"] - first["t0"]
    assert len(_runs(redis_client, spot)) == 2, "it was preempted once it was old enough"
    app.close()


# -- RFC 27 annotations ----------------------------------------------------------------------


def test_explain_json_gives_a_waiting_job_a_reason_and_a_start_estimate_close_to_its_start(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The blocker's limit is 4 s and it runs 3.5 s: the estimate (its start + 4 s) is
    within a second of the real start, well within the few seconds the contract asks."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with running([_worker("one", redis_url, "nvidia-a100x1", tmp_path)], store):
        blocker = record.apply_async(args=["blocker", 3.5], headers={"ext_ml_timeout_seconds": 4})
        _wait(lambda: _started(store, blocker.id), 20, "the blocker to start")
        waiting = record.apply_async(args=["waiting", 0.1])
        seen = _wait(lambda: _annotated(app, waiting.id), 10, "the leader's annotation")
        done = _wait(lambda: _result(redis_client, waiting.id), 20, "the waiting job")
        assert _explain(app, waiting.id)["state"] in {"unknown", "running"}
    assert seen["state"] == "pending" and seen["worker"] == "one@test", seen
    assert "gpu_count" in seen["reason_pending"], seen
    assert abs(seen["t_estimate"] - done["start"]) <= 2.0, (seen, done["start"])
    app.close()


def test_a_running_jobs_celery_time_limit_gives_the_waiting_job_its_start_estimate(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Ends are estimated from `ext_ml_timeout_seconds`, a Flux duration or the
    task's `time_limit`. The blocker has only Celery's own hard `time_limit` (5 s) and
    runs 4 s: the worker writes that limit in its lease, so the waiting job's estimate is
    the blocker's start + 5 s. Before, a running job's Celery limit was not kept in its
    lease, and the waiting job had no estimate at all."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with running([_worker("one", redis_url, "nvidia-a100x1", tmp_path)], store):
        blocker = record.apply_async(args=["blocker", 4.0], time_limit=5)
        _wait(lambda: _started(store, blocker.id), 20, "the blocker to start")
        waiting = record.apply_async(args=["waiting", 0.1])
        seen = _wait(lambda: _annotated(app, waiting.id), 10, "the leader's annotation")
        done = _wait(lambda: _result(redis_client, waiting.id), 20, "the waiting job")
    ran = _result(redis_client, blocker.id)
    assert ran is not None, "the blocker never ended"
    assert abs(seen["t_estimate"] - (ran["start"] + 5.0)) <= 1.5, (seen, ran)
    assert abs(seen["t_estimate"] - done["start"]) <= 2.0, (seen, done["start"])
    app.close()


def _annotated(app: Celery, task_id: str) -> dict[str, Any] | None:
    found = _explain(app, task_id)
    return found if found.get("t_estimate") else None


# -- failures --------------------------------------------------------------------------------


def test_after_the_leader_is_sigkilled_another_worker_leads_within_the_ttl_and_jobs_run_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ttl = 2.0
    env = {
        "OJS_TEST_LEADER_TTL": str(ttl),
        "OJS_TEST_LEASE_TTL": "3",
        "OJS_TEST_ASSIGN_TIMEOUT": "3",
    }
    store = OJSStore(redis_client, prefix="ojs")
    book = PendingBook(store)
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    workers = {n: _worker(n, redis_url, "nvidia-a100x2", tmp_path, **env) for n in "ab"}
    with running(list(workers.values()), store):
        leader = _wait(book.leader, 15, "a leader")["id"]
        ids = [record.apply_async(args=[f"j{i}", 3.0]).id for i in range(10)]
        _wait(lambda: _busy(store, leader) == 2, 20, "the leader's worker to run two jobs")
        time.sleep(0.5)  # killed mid-run: its two jobs are re-run once, from their leases
        killed = time.monotonic()
        workers[leader.split("@")[0]].kill()
        other = _wait(lambda: (book.leader() or {}).get("id") not in {None, leader}, ttl + 5, "x")
        took = time.monotonic() - killed
        _wait(lambda: len(_results(redis_client)) >= len(ids), 90, "every job")
        time.sleep(1.0)  # a duplicate would show up here
    assert other, "a new leader"
    assert took <= ttl + SLACK_S, took
    done = [r["task_id"] for r in _results(redis_client)]
    assert sorted(done) == sorted(ids), "each job completed exactly once"
    app.close()


def test_an_assignment_whose_message_is_dropped_is_taken_back_and_the_job_runs_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The GPU worker is stopped (SIGSTOP) so it cannot take its message; the message is then
    deleted from its queue. After `ojs_ml_assignment_timeout_s` (2 s) the leader takes the
    assignment back and assigns it again; the worker, resumed, runs the job once."""
    store = OJSStore(redis_client, prefix="ojs")
    book = PendingBook(store)
    app = make_app(redis_url)
    env = {"OJS_TEST_ASSIGN_TIMEOUT": "2"}
    leader = _worker("lead", redis_url, "cpu", tmp_path, **env)
    # a 3 s heartbeat keeps the stopped worker live (3 heartbeats) for the whole test
    conf = json.dumps({"ojs_ml_scheduler": "off", "ojs_ml_heartbeat_s": 3})
    gpu = _worker("gpu", redis_url, "nvidia-a100x1", tmp_path, **env, OJS_TEST_CONF=conf)
    with running([leader, gpu], store):
        _wait(lambda: (book.leader() or {}).get("id") == "lead@test", 15, "lead@test to lead")
        assert gpu.proc is not None
        os.kill(gpu.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # its blocking pop (1 s) returns; it pops nothing more
            job = app.tasks["ml.record"].apply_async(args=["once", 0.1])
            first = _wait(lambda: _assigned(book, job.id), 10, "the assignment")
            queue = worker_queue_name("ojs", "gpu@test")
            dropped = sum(int(redis_client.delete(k)) for k in redis_client.keys(f"{queue}*"))
            assert dropped == 1, "the assigned message was in the stopped worker's queue"
            again = _wait(lambda: _reassigned(book, job.id, first["token"]), 2 + 2 * SLACK_S, "x")
        finally:
            os.kill(gpu.proc.pid, signal.SIGCONT)
        done = _wait(lambda: _result(redis_client, job.id), 20, "the job to run")
        time.sleep(1.0)  # a duplicate would show up here
    assert first["worker"] == again["worker"] == done["worker"] == "gpu@test"
    assert len([r for r in _results(redis_client) if r["task_id"] == job.id]) == 1
    assert f"took back {job.id} from gpu@test" in leader.output()
    app.close()


def _reassigned(book: PendingBook, task_id: str, token: str) -> dict[str, Any] | None:
    """The record once it is assigned again, under a new token."""
    record = _assigned(book, task_id)
    return record if record and record.get("token") != token else None


def _busy(store: OJSStore, worker: str) -> int:
    devices = (store.live_workers().get(worker) or {}).get("free", {}).get("devices") or {}
    return sum(1 for holder in devices.values() if holder)


def _assigned(book: PendingBook, task_id: str) -> dict[str, Any] | None:
    record = book.get(task_id)
    return record if record and record.get("state") == "assigned" else None


def test_prioritize_moves_a_waiting_job_ahead_of_jobs_submitted_before_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """RFC 27 prioritize through `celery ojs-ml prioritize TASK_ID PRIORITY` (higher first)."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
    with running([_worker("one", redis_url, "nvidia-a100x1", tmp_path)], store):
        blocker = record.apply_async(args=["blocker", 2.0])
        _wait(lambda: _started(store, blocker.id), 20, "the blocker to start")
        first, second, last = (record.apply_async(args=[t, 0.1]).id for t in "abc")
        _wait(lambda: PendingBook(store).get(last), 10, "the leader to admit the last job")
        result = CliRunner().invoke(cli, ["prioritize", last, "9"], obj=obj)
        assert result.exit_code == 0, result.output
        unknown = CliRunner().invoke(cli, ["prioritize", "no-such-job", "9"], obj=obj)
        assert unknown.exit_code == 1
        _wait(lambda: len(_results(redis_client)) == 4, 30, "all four jobs")
    by_id = {r["task_id"]: r for r in _results(redis_client)}
    assert by_id[last]["start"] < by_id[first]["start"] < by_id[second]["start"]
    app.close()


def test_a_job_past_the_queue_depth_still_backfills_on_the_next_full_pass(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_queue_depth` 1: passes between full ones decide only the blocked 4-GPU job
    first in order; the short 1-GPU job behind it fits before that job's reserved start
    (backfill) and is started by a full pass (`ojs_ml_full_pass_s`), while the job that
    holds the GPUs still runs."""
    conf = json.dumps({"ojs_ml_queue_depth": 1, "ojs_ml_full_pass_s": 0.5})
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    worker = _worker("four", redis_url, "nvidia-a100x4", tmp_path, conc=4, OJS_TEST_CONF=conf)
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        holder = record.apply_async(
            args=["holder", 4.0], headers={"ext_ml_gpu_count": 2, "ext_ml_timeout_seconds": 8}
        )
        time.sleep(SLACK_S)  # the holder starts on the idle worker
        big = record.apply_async(args=["big", 0.1], headers={"ext_ml_gpu_count": 4})
        small = record.apply_async(
            args=["small", 0.1], headers={"ext_ml_gpu_count": 1, "ext_ml_timeout_seconds": 1}
        )
        _wait(lambda: _result(redis_client, big.id), 30, "the 4-GPU job")
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert runs[small.id]["end"] < runs[holder.id]["end"], "the backfill job waited"
    assert runs[big.id]["start"] >= runs[holder.id]["end"] - 0.05
    app.close()
