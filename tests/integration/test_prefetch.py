"""`ojs_ml_prefetch` on a real worker: jobs delivered ahead of capacity wait at the gate
and start as soon as a job ends; every job still runs exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import HOLD_KEY, RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def test_prefetched_jobs_wait_at_the_gate_and_every_job_runs_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=3,
                           extra_env={"OJS_TEST_CONF": conf})  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        ids = [app.tasks["ml.record"].apply_async(args=[f"p{i}", 0.3]).id for i in range(10)]
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # nothing runs twice afterwards
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert sorted(r["task_id"] for r in runs) == sorted(ids), "a job was lost or ran twice"
    for r in runs:  # never more than 2 GPUs in use at any instant
        at_once = [o for o in runs if o["start"] <= r["start"] < o["end"]]
        assert len(at_once) <= 2, at_once
    log = (tmp_path / "a.log").read_text()
    assert "ojs-ml: holding" in log, "no job was delivered ahead of capacity"
    app.close()


@pytest.mark.parametrize("grants", [False, True], ids=["one decision per job", "grants on"])
def test_a_prefetched_job_is_taken_back_when_another_worker_can_start_it_first(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, grants: bool
) -> None:
    """The job reserved (and prefetched) on the worker whose job's time limit ends first
    does not wait there when the other worker frees earlier: the leader takes it back.
    With grants on (the default) `next` may instead be sent under a grant, and the grant
    ends the same way (its holder has a job waiting while the other worker has room):
    the same outcome, by the grant's path, so the prefetch log line is checked only with
    one decision per job."""
    app = make_app(redis_url, ojs_ml_grants=grants)
    record = app.tasks["ml.record"]
    # max_hold_s 30: `next`'s planned start (the long job's limit, 6.5 s away) counts as soon
    conf = json.dumps({"ojs_ml_prefetch": 1, "ojs_ml_max_hold_s": 30, "ojs_ml_grants": grants})
    env = {"OJS_TEST_CONF": conf}
    workers = [
        WorkerProcess(
            name, redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2, extra_env=env
        )
        for name in ("a", "b")
    ]
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        long = record.apply_async(args=["long", 6.0], headers={"ext_ml_timeout_seconds": 8})
        time.sleep(1.0)
        short = record.apply_async(args=["short", 1.5], headers={"ext_ml_timeout_seconds": 300})
        time.sleep(0.5)
        nxt = record.apply_async(args=["next", 0.1])
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([long.id, short.id, nxt.id]), runs
    assert runs[long.id]["worker"] != runs[short.id]["worker"]
    assert runs[nxt.id]["worker"] == runs[short.id]["worker"], runs
    assert runs[nxt.id]["start"] < runs[long.id]["end"], "it waited for the long job"
    logs = "".join((tmp_path / f"{w}.log").read_text() for w in ("a", "b"))
    assert grants or f"took prefetched {nxt.id} back" in logs
    app.close()


def test_a_job_published_later_in_a_higher_band_starts_before_a_job_prefetched_ahead_of_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Order rule 1 with prefetch: a spot job waits at the only worker's gate behind a
    running one; a reserved-band job published next must start first. The leader takes
    the spot job back (the gate would start it the moment the GPU frees)."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    conf = json.dumps({"ojs_ml_prefetch": 1})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           extra_env={"OJS_TEST_CONF": conf})  # fmt: skip
    spot = {"ext_ml_priority_class": "spot"}
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        # a time limit within max_hold_s / 2: the job after it is likely to start soon
        first = record.apply_async(
            args=["first", 2.5], headers={**spot, "ext_ml_timeout_seconds": 4}
        )
        time.sleep(0.6)
        cheap = record.apply_async(args=["cheap", 0.2], headers=spot)
        deadline = time.monotonic() + 10
        log = tmp_path / "a.log"
        while f"holding {cheap.id}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"holding {cheap.id}" in log.read_text(), "the spot job was not sent ahead"
        urgent = record.apply_async(
            args=["urgent", 0.2], headers={"ext_ml_priority_class": "reserved"}
        )
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([first.id, cheap.id, urgent.id]), "a job was lost or ran twice"
    assert runs[urgent.id]["start"] < runs[cheap.id]["start"], "the spot job overtook it"
    assert f"took prefetched {cheap.id} back" in log.read_text()
    app.close()


def test_a_prefetching_worker_reads_that_many_more_messages_ahead(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A running ML job's message stays unacked until its lease is written (a short job:
    until it ends), so each running job takes one unit of the consumer's prefetch count.
    With `-c` as many processes as GPUs, a prefetched message would then only be read
    once a job ended. `ojs_ml_prefetch = N` raises the count by N (`MLWorker._open_prefetch`)."""
    app = make_app(redis_url)
    env = {"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 3})}
    workers = [
        WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env=env),
        WorkerProcess("b", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env={"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 0})}),
    ]  # fmt: skip
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        stats: dict[str, Any] = {}
        deadline = time.monotonic() + 15
        while len(stats) < 2 and time.monotonic() < deadline:
            stats = app.control.inspect(timeout=1.0, destination=["a@test", "b@test"]).stats() or {}
    assert stats["a@test"]["prefetch_count"] == stats["b@test"]["prefetch_count"] + 3, stats
    app.close()


def test_a_taken_back_copy_held_at_the_gate_does_not_block_the_jobs_held_behind_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The leader takes back prefetched jobs that do not start within the assignment
    timeout (1 s here, under the running jobs' 3 s) and delivers them again to the same
    worker, so the gate holds a stale copy ahead of the current one. When the running
    jobs end, the stale copy is started, found stale and dropped: the GPUs it was given
    are free, and the held jobs behind it must start on them, although no job runs
    there any more to release anything (found with a leader failover under prefetch:
    every later copy waited behind a stale one, and five jobs of ten never ran)."""
    app = make_app(redis_url)
    env = {"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 2}), "OJS_TEST_ASSIGN_TIMEOUT": "1"}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=4,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        limit = {"ext_ml_timeout_seconds": 4}  # a planned start within max_hold_s / 2
        ids = [
            app.tasks["ml.record"].apply_async(args=[f"s{i}", 3.0], headers=limit).id
            for i in range(4)
        ]
        deadline = time.monotonic() + 30
        while redis_client.llen(RESULTS_KEY) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # nothing runs twice afterwards
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert sorted(r["task_id"] for r in runs) == sorted(ids), "a job was lost or ran twice"
    log = (tmp_path / "a.log").read_text()
    assert "was assigned elsewhere since; dropping this copy" in log, "no stale copy was held"
    first_end = min(r["end"] for r in runs)
    later = sorted(r["start"] for r in runs)[2:]
    assert all(start - first_end < 2.0 for start in later), (
        f"the held jobs waited {[round(s - first_end, 2) for s in later]} s after GPUs freed"
    )
    app.close()


def test_prioritize_moves_a_prefetched_job_ahead_of_those_prefetched_before_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """RFC 27 prioritize of a job already delivered ahead to a gate: it is taken back
    (fenced by its token), placed again in its new order, delivered with its new
    priority, and the gate starts it before the jobs published before it."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    book = PendingBook(OJSStore(redis_client, prefix="ojs"))
    # The blocker holds the GPU until the test releases it; its time limit (20 s) puts
    # the jobs' planned start within half of ojs_ml_max_hold_s, so they go ahead.
    conf = {"ojs_ml_prefetch": 3, "ojs_ml_max_hold_s": 60}
    env = {"OJS_TEST_CONF": json.dumps(conf)}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        hold = app.tasks["ml.hold"]
        blocker = hold.apply_async(args=["blocker"], headers={"ext_ml_timeout_seconds": 20}).id
        time.sleep(0.5)
        first, second, last = (record.apply_async(args=[t, 0.1]).id for t in "abc")
        token = _wait_assigned(book, last, None)
        assert app.ojs_ml.prioritize(last, 9), "an assigned job not started yet is reordered"
        _wait_assigned(book, last, token)  # taken back and delivered again, newly ordered
        time.sleep(1.0)  # the new delivery reaches the gate (the blocker holds the GPU)
        redis_client.set(HOLD_KEY + "blocker", 1)
        deadline = time.monotonic() + 30
        while redis_client.llen(RESULTS_KEY) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([blocker, first, second, last]), "a job was lost or ran twice"
    assert runs[last]["start"] < runs[first]["start"] < runs[second]["start"], runs
    app.close()


def test_a_job_that_may_preempt_is_not_delivered_ahead_and_preempts_once_its_victim_is_old(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reserved job reserved behind a running spot job is not delivered ahead: a job at a
    gate cannot be planned a preemption, so it would wait for the spot job's end. It
    waits in the pending set and preempts once the victim has run the minimum runtime."""
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2})
    env = {"OJS_TEST_CONF": conf, "OJS_TEST_MIN_RUNTIME": "2", "OJS_TEST_CKPT": str(tmp_path)}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=3,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        spot = (
            app.tasks["ml.ckpt_train"]
            .apply_async(args=[30, 0.25], headers={"ext_ml_priority_class": "spot"})
            .id
        )
        deadline = time.monotonic() + 20
        while not redis_client.llen(f"ojs-test:runs:{spot}"):
            assert time.monotonic() < deadline, "the spot job never ran"
            time.sleep(0.05)
        reserved = (
            app.tasks["ml.record"]
            .apply_async(args=["reserved", 0.2], headers={"ext_ml_priority_class": "reserved"})
            .id
        )
        deadline = time.monotonic() + 20
        while redis_client.llen(RESULTS_KEY) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while not redis_client.get(f"ojs-test:done:{spot}") and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:runs:{spot}", 0, -1)]
    done = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert [r["task_id"] for r in done] == [reserved], done
    assert done[0]["start"] < runs[0]["t0"] + 30 * 0.25, "it waited for the spot job's end"
    assert len(runs) == 2, "the spot job was preempted once and resumed"
    log = (tmp_path / "a.log").read_text()
    assert f"assigned {reserved} to a@test (ahead of capacity" not in log
    app.close()


def test_with_the_defaults_the_next_job_waits_at_the_gate_and_explain_shows_it_waiting(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_prefetch` is on by default (2): a job planned to start within
    `ojs_ml_max_hold_s / 2` on a full worker is sent to its gate ahead of time, `explain
    --json` shows it `pending` with `ahead`, its worker, a reason and an estimate, and it
    starts right after the blocker ends, without waiting for a scheduler pass."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_ojs_ml.cli.main import cli

    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    book = PendingBook(OJSStore(redis_client, prefix="ojs"))
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2)

    def explain(task_id: str) -> dict[str, Any]:
        obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
        args = ["explain", task_id, "--json", "--timeout", "0.5"]
        result = CliRunner().invoke(cli, args, obj=obj, catch_exceptions=False)
        return dict(json.loads(result.stdout))

    with running([worker], OJSStore(redis_client, prefix="ojs")):
        blocker = record.apply_async(args=["blocker", 2.5], headers={"ext_ml_timeout_seconds": 3})
        deadline = time.monotonic() + 20
        while (book.get(blocker.id) or {}).get("state") != "started":
            assert time.monotonic() < deadline, "the blocker never started"
            time.sleep(0.05)
        nxt = record.apply_async(args=["next", 0.1])
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while not seen.get("ahead"):
            assert time.monotonic() < deadline, f"never sent ahead: {seen}"
            seen = explain(nxt.id)
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while redis_client.llen(RESULTS_KEY) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([blocker.id, nxt.id]), "a job was lost or ran twice"
    assert seen["state"] == "pending" and seen["worker"] == "a@test", seen
    assert "delivered ahead to a@test" in seen["reason_pending"], seen
    assert abs(seen["t_estimate"] - runs[nxt.id]["start"]) <= 2.0, (seen, runs[nxt.id])
    # the gate starts it as the blocker ends; the bound leaves room for a loaded machine
    # (0.5 s was once exceeded with the whole suite running on two cores)
    assert runs[nxt.id]["start"] - runs[blocker.id]["end"] < 1.5, "it waited for the heartbeat"
    app.close()


def test_a_job_held_ahead_gets_a_new_start_estimate_when_a_job_before_it_ends_early(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two jobs run on a 2-GPU worker, `short` (limit 8 s) and `early` (limit 12 s, but it
    ends after 4 s). `first` (5 s) and `second` are sent ahead with the estimates of those
    two ends. Once `early` ends, `first` starts in its place and `second` now waits for
    `short`: `explain` moves its estimate to `short`'s end (it would have stayed 12 s after
    the start otherwise), and it starts within a second of that estimate.

    The estimate before is read from the pending set while `early` still runs (read
    after it), and from the first annotation on: `second` is sent ahead after `first`,
    and the core plans it as if `first` ran already (one end too early, `short`'s); the
    pass that sends it gives it the gate's estimate at once (CI caught it)."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_ojs_ml.cli.main import cli
    from celery_ojs_ml.cli.sched import entry

    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    book = PendingBook(OJSStore(redis_client, prefix="ojs"))
    conf = {"OJS_TEST_CONF": json.dumps({"ojs_ml_max_hold_s": 30})}  # ahead within 15 s
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=4, extra_env=conf
    )

    def explain(task_id: str) -> dict[str, Any]:
        obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
        args = ["explain", task_id, "--json", "--timeout", "0.5"]
        result = CliRunner().invoke(cli, args, obj=obj, catch_exceptions=False)
        return dict(json.loads(result.stdout))

    def wait_for(what: str, check: Any, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (found := check()):
            assert time.monotonic() < deadline, what
            time.sleep(0.05)
        return found

    def state(task_id: str) -> Any:
        return (book.get(task_id) or {}).get("state")

    def both_ahead() -> dict[str, Any] | None:
        seen = [entry(book.get(j.id) or {}) for j in (first, second)]
        if not all(s.get("ahead") for s in seen):
            return None
        assert state(early.id) == "started", "early ended before both were seen ahead"
        return seen[1]

    with running([worker], OJSStore(redis_client, prefix="ojs")):
        short = record.apply_async(args=["short", 7.8], headers={"ext_ml_timeout_seconds": 8})
        early = record.apply_async(args=["early", 4.0], headers={"ext_ml_timeout_seconds": 12})
        wait_for("a blocker never started", lambda: state(short.id) == state(early.id) == "started")
        first = record.apply_async(args=["first", 5.0])  # still running when short ends
        second = record.apply_async(args=["second", 0.1])
        before = wait_for("not both sent ahead", both_ahead)
        assert before["t_estimate"] is not None, before
        wait_for("first never started", lambda: state(first.id) == "started")

        def moved() -> dict[str, Any] | None:
            seen = explain(second.id)
            t = seen.get("t_estimate")
            return seen if t is not None and t < before["t_estimate"] - 2 else None

        now = wait_for("the estimate never moved", moved, timeout_s=5)
        wait_for("not all ran", lambda: redis_client.llen(RESULTS_KEY) >= 4)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    ids = [short.id, early.id, first.id, second.id]
    assert sorted(runs) == sorted(ids), "a job was lost or ran twice"
    assert now["state"] == "pending" and now.get("ahead"), now
    assert abs(before["t_estimate"] - (runs[early.id]["start"] + 12)) <= 1.0, (before, runs)
    assert abs(now["t_estimate"] - runs[second.id]["start"]) <= 1.0, (now, runs[second.id])
    assert runs[second.id]["start"] >= runs[short.id]["end"] - 0.05, "it did not wait for short"
    app.close()


def _wait_assigned(book: PendingBook, task_id: str, old_token: str | None) -> str:
    """The job's token once it is assigned under a token other than `old_token`."""
    deadline = time.monotonic() + 20
    while True:
        record = book.get(task_id) or {}
        if record.get("state") == "assigned" and record.get("token") != old_token:
            return str(record["token"])
        assert time.monotonic() < deadline, record
        time.sleep(0.02)
