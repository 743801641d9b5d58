"""Flux RFC 27 DENY in the live scheduler: a job that becomes unsatisfiable after publish.

With `ojs_ml_deny_unsatisfiable`, a waiting job whose only capable worker left the
fleet is denied once that worker has been gone `ojs_ml_deny_after_s` ("Alloc Deny":
the request can never be fulfilled): its result is a failure naming the reason and it
is dead-lettered. A worker back within that time saves the job, which then runs.
Workers run without grants or prefetch, so the waiting job stays in the pending set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.store.deadletter import dead_jobs
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import HOLD_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

L4 = {"ext_ml_gpu_type": "nvidia-l4"}


def _conf(deny_after_s: float) -> dict[str, Any]:
    return {
        "ojs_ml_deny_unsatisfiable": True,
        "ojs_ml_deny_after_s": deny_after_s,
        "ojs_ml_grants": False,
        "ojs_ml_prefetch": 0,
    }


def _fleet(tmp_path: Path, conf: dict[str, Any], redis_url: str) -> list[WorkerProcess]:
    env = {"OJS_TEST_CONF": json.dumps(conf)}
    return [
        WorkerProcess(name, redis_url, profile, tmp_path, concurrency=2, extra_env=env)
        for name, profile in (("a", "profile:nvidia-a100x2"), ("l4", "profile:nvidia-l4x1"))
    ]


def _until(what: str, check: Any, workers: list[WorkerProcess], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}:\n" + workers[0].output()[-3000:]
        time.sleep(0.1)
    return found


def _state(book: PendingBook, task_id: str) -> str | None:
    return (book.get(task_id) or {}).get("state")


def _annotation(book: PendingBook, task_id: str) -> str:
    """The leader's `reason_pending` for a waiting job ("" before its first note)."""
    note = (book.get(task_id) or {}).get("annotation") or {}
    return str(note.get("reason_pending") or "")


@contextmanager
def _started(fleet: list[WorkerProcess], store: OJSStore) -> Iterator[list[WorkerProcess]]:
    """`a` first, until it holds the scheduler lock, then the L4 worker (yielded in a list
    that `running` stops, with any worker appended to it)."""
    with running(fleet[:1], store):
        _until("a leads", lambda: (PendingBook(store).leader() or {}).get("id") == "a@test", fleet)
        with running(fleet[1:], store) as l4:
            yield l4


def _waiting_on_busy_l4(
    app: Celery, book: PendingBook, fleet: list[WorkerProcess]
) -> tuple[str, str]:
    """The L4 worker runs a holding job; an L4 job waits for it. Their ids (waiting first)."""
    hold = app.tasks["ml.hold"].apply_async(args=["l4", 120], headers=L4).id
    _until("the L4 worker runs the holding job", lambda: _state(book, hold) == "started", fleet)
    job = str(app.tasks["ml.record"].apply_async(args=["waits"], headers=L4).id)
    _until("the L4 job waits", lambda: _state(book, job) == "pending", fleet)
    return job, hold


def test_a_job_whose_only_capable_worker_left_is_denied_after_the_configured_time(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """RFC 27 "Alloc Deny" with `ojs_ml_deny_after_s` 2: failure and dead letter, with the note."""
    conf = _conf(2.0)
    app = make_app(redis_url, **conf)
    store = OJSStore(redis_client, prefix="ojs")
    book = PendingBook(store)
    fleet = _fleet(tmp_path, conf, redis_url)
    with _started(fleet, store):
        job, hold = _waiting_on_busy_l4(app, book, fleet)
        fleet[1].kill()  # the only L4 worker dies: its heartbeat stops
        gone_at = time.time()
        result = app.AsyncResult(job)
        _until("the job is denied", lambda: result.state == "FAILURE", fleet)
        denied_at = time.time()
        # The job that ran there crashed with it: re-published by lease recovery, it is
        # not refused at publish (and lost) but waits in the intake, and is denied too.
        crashed = app.AsyncResult(hold)
        _until("the crashed job is denied", lambda: crashed.state == "FAILURE", fleet)
        dead = {d["task_id"]: d for d in dead_jobs(store)}
    assert denied_at - gone_at >= 2.0, "denied before the worker had been gone 2 s"
    note = str(result.result)
    assert note.startswith(
        "RFC 27 DENY: no worker that can run it has been live for 2 s (ojs_ml_deny_after_s): "
    ), note
    assert "gpu_type nvidia-a100 not in [nvidia-l4]" in note
    assert dead[job]["reason"] == f"refused by the scheduler: {note}"
    assert _state(book, job) not in ("pending", "assigned"), "a denied job left the pending set"
    assert str(crashed.result).startswith("RFC 27 DENY: "), crashed.result
    assert dead[hold]["reason"].startswith("refused by the scheduler: RFC 27 DENY: ")
    app.close()


def test_a_job_whose_capable_worker_comes_back_within_the_time_is_not_denied_and_runs(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The control: the L4 worker restarts within `ojs_ml_deny_after_s` (20 s), after the
    leader has led that long, so that it would deny the job were the worker not away."""
    deny_after_s = 20.0
    conf = _conf(deny_after_s)
    app = make_app(redis_url, **conf)
    store = OJSStore(redis_client, prefix="ojs")
    book = PendingBook(store)
    fleet = _fleet(tmp_path, conf, redis_url)
    with _started(fleet, store) as l4:
        led_since = time.monotonic()  # `a` leads from before this
        job, _ = _waiting_on_busy_l4(app, book, fleet)
        time.sleep(max(0.0, led_since + deny_after_s + 1 - time.monotonic()))
        l4[0].kill()
        redis_client.set(HOLD_KEY + "l4", 1)  # the holding job's re-run ends at once
        _until("the L4 worker is away", lambda: "worker away" in _annotation(book, job), fleet)
        back = WorkerProcess("l4", redis_url, "profile:nvidia-l4x1", tmp_path,
                             concurrency=2, extra_env=fleet[1].env)  # fmt: skip
        l4.append(back.start())
        back.wait_live(store)
        ran = app.AsyncResult(job).get(timeout=60)
    assert ran["tag"] == "waits" and ran["worker"] == "l4@test"
    assert job not in {d["task_id"] for d in dead_jobs(store)}
    app.close()
